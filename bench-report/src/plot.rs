//! SVG figures: one or more panels under a title, each a grouped bar chart or a line chart over
//! the same data shape (categories along x, one value per category and series).
//!
//! Grouped bars fit figures per configuration (latency percentiles, overhead per mode, frame
//! rates per device); lines fit a quantity that changes with an ordered x (throughput against
//! the number of devices). Every panel has its own title, axis labels (with units) and legend,
//! and bars carry their value.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Most panels in one figure (an experiment has a panel per run): more are unreadable.
pub const MAX_PANELS: usize = 32;
/// Most categories in one panel (glmark2's suite has 33 scenes).
pub const MAX_CATEGORIES: usize = 128;
/// Most series in one panel: the palette and the legend stay readable up to here.
pub const MAX_SERIES: usize = 12;
/// Most bars in a panel that are labelled with their value (more would overlap).
const MAX_LABELLED_BARS: usize = 48;

/// Why no figure was written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Nothing to draw, or more than a figure holds.
    #[error("{0}")]
    Shape(String),
    /// A value is NaN or infinite.
    #[error("panel {panel:?}: series {series:?} has a non-finite value at {category:?}")]
    NotFinite {
        panel: String,
        series: String,
        category: String,
    },
    /// The SVG could not be drawn or written.
    #[error("drawing the figure: {0}")]
    Draw(String),
}

/// How a panel shows its series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One group of bars per category, a bar per series.
    Bars,
    /// A line per series through its values, categories evenly spaced in order.
    Lines,
}

/// One series: the legend's name and a value per category (`None`: no value there).
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub values: Vec<Option<f64>>,
}

impl Series {
    pub fn new(name: impl Into<String>, values: Vec<Option<f64>>) -> Series {
        Series {
            name: name.into(),
            values,
        }
    }
}

/// One chart of a figure.
#[derive(Debug, Clone)]
pub struct Panel {
    pub kind: Kind,
    pub title: String,
    /// The x axis: what the categories are.
    pub x_label: String,
    /// The y axis: the quantity and its unit.
    pub y_label: String,
    pub categories: Vec<String>,
    pub series: Vec<Series>,
}

impl Panel {
    /// A panel without series yet.
    pub fn new(
        kind: Kind,
        title: impl Into<String>,
        x_label: impl Into<String>,
        y_label: impl Into<String>,
        categories: Vec<String>,
    ) -> Panel {
        Panel {
            kind,
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            categories,
            series: Vec::new(),
        }
    }

    /// Adds a series.
    pub fn with(mut self, series: Series) -> Panel {
        self.series.push(series);
        self
    }

    /// Checks the panel; returns the y range to draw (from 0 or below, with room for the
    /// legend above the highest value).
    fn y_range(&self) -> Result<(f64, f64), PlotError> {
        let shape = |what: String| PlotError::Shape(format!("panel {:?}: {what}", self.title));
        if self.categories.is_empty() || self.categories.len() > MAX_CATEGORIES {
            return Err(shape(format!(
                "{} categories (1 to {MAX_CATEGORIES})",
                self.categories.len()
            )));
        }
        if self.series.is_empty() || self.series.len() > MAX_SERIES {
            return Err(shape(format!(
                "{} series (1 to {MAX_SERIES})",
                self.series.len()
            )));
        }
        let (mut lo, mut hi) = (0.0f64, 0.0f64);
        let mut any = false;
        for s in &self.series {
            if s.values.len() != self.categories.len() {
                return Err(shape(format!(
                    "series {:?} has {} values for {} categories",
                    s.name,
                    s.values.len(),
                    self.categories.len()
                )));
            }
            for (v, category) in s.values.iter().zip(&self.categories) {
                let Some(v) = *v else { continue };
                if !v.is_finite() {
                    return Err(PlotError::NotFinite {
                        panel: self.title.clone(),
                        series: s.name.clone(),
                        category: category.clone(),
                    });
                }
                any = true;
                lo = lo.min(v);
                hi = hi.max(v);
            }
        }
        if !any {
            return Err(shape("no values".into()));
        }
        let span = if hi > lo { hi - lo } else { 1.0 };
        // Room for the value labels and the legend box (a line per series).
        let room = 0.12 + 0.07 * self.series.len() as f64;
        Ok((lo, hi + span * room))
    }

    /// Pixels of the widest category label, at [`LABEL_PX_PER_CHAR`].
    fn label_width(&self) -> usize {
        let longest = self.categories.iter().map(|c| label(c).chars().count());
        longest.max().unwrap_or(0) * LABEL_PX_PER_CHAR
    }

    /// The panel's width with horizontal category labels, if they fit in [`MAX_PANEL_WIDTH`].
    fn horizontal_width(&self) -> Option<usize> {
        let n = self.categories.len();
        let per_category = match self.kind {
            Kind::Bars => 24 * self.series.len(),
            Kind::Lines => 90,
        };
        let width = 140 + n * per_category.max(self.label_width() + 12);
        (width <= MAX_PANEL_WIDTH).then_some(width)
    }

    /// Pixel size the panel needs: category labels horizontal when they fit, else vertical
    /// below the axis.
    fn size(&self) -> (u32, u32) {
        let (width, height) = match self.horizontal_width() {
            Some(w) => (w, 420),
            None => (
                140 + 24 * self.categories.len() * self.series.len(),
                400 + self.label_width(),
            ),
        };
        (width.clamp(520, MAX_PANEL_WIDTH) as u32, height as u32)
    }
}

/// Widest panel (pixels).
const MAX_PANEL_WIDTH: usize = 1600;
/// Longest category label drawn (characters); longer ones are cut with an ellipsis.
const MAX_LABEL_CHARS: usize = 40;
/// Pixels per character of an 11-pixel sans-serif label, generously.
const LABEL_PX_PER_CHAR: usize = 6;

/// A category's label as drawn: cut at [`MAX_LABEL_CHARS`].
fn label(category: &str) -> String {
    if category.chars().count() <= MAX_LABEL_CHARS {
        category.to_owned()
    } else {
        let cut: String = category.chars().take(MAX_LABEL_CHARS - 1).collect();
        format!("{cut}…")
    }
}

/// Series colours, in order: one for each of [`MAX_SERIES`] series, told apart by hue first.
const COLOURS: [RGBColor; MAX_SERIES] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
    RGBColor(255, 215, 0),
];

/// A value for a label, to three significant digits or so: thousands and millions shortened.
pub fn short(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        format!("{:.1}M", v / 1e6)
    } else if a >= 1e5 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 1e4 {
        format!("{:.1}k", v / 1e3)
    } else if a >= 100.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Writes `panels` under `title` to `path` as SVG, `columns` panels per row.
pub fn write_svg(
    path: &Path,
    title: &str,
    panels: &[Panel],
    columns: usize,
) -> Result<(), PlotError> {
    if panels.is_empty() || panels.len() > MAX_PANELS {
        return Err(PlotError::Shape(format!(
            "{} panels (1 to {MAX_PANELS})",
            panels.len()
        )));
    }
    let ranges = panels
        .iter()
        .map(Panel::y_range)
        .collect::<Result<Vec<_>, _>>()?;
    let columns = columns.clamp(1, panels.len());
    let rows = panels.len().div_ceil(columns);
    let (w, h) = panels
        .iter()
        .map(Panel::size)
        .fold((0, 0), |(w, h), (pw, ph)| (w.max(pw), h.max(ph)));
    // At most 32 panels of at most 1600x680 and a title up to 3200 wide: no overflow.
    let title_width = (title.chars().count() * 10 + 40).min(2 * MAX_PANEL_WIDTH) as u32;
    let size = ((w * columns as u32).max(title_width), 50 + h * rows as u32);
    let err = |e: DrawingAreaErrorKind<std::io::Error>| PlotError::Draw(e.to_string());
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let body = root.titled(title, ("sans-serif", 20)).map_err(err)?;
    for ((area, panel), (lo, hi)) in body
        .split_evenly((rows, columns))
        .iter()
        .zip(panels)
        .zip(ranges)
    {
        draw_panel(area, panel, lo, hi)?;
    }
    root.present().map_err(err)
}

/// Draws one panel into `area`.
fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    panel: &Panel,
    lo: f64,
    hi: f64,
) -> Result<(), PlotError> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| PlotError::Draw(e.to_string());
    let n = panel.categories.len();
    let vertical = panel.horizontal_width().is_none();
    let mut chart = ChartBuilder::on(area)
        .caption(&panel.title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(if vertical {
            40 + panel.label_width() as u32
        } else {
            45
        })
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n as f64, lo..hi)
        .map_err(err)?;
    // Category i sits at i + 0.5; with 2n+1 labels plotters puts a tick on every half.
    let tick_label = |x: &f64| {
        let i = x.floor();
        match panel.categories.get(i as usize) {
            Some(c) if !vertical && (x - i - 0.5).abs() < 1e-6 && i >= 0.0 => label(c),
            _ => String::new(),
        }
    };
    let y_label = |y: &f64| short(*y);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(panel.x_label.as_str())
        .y_desc(panel.y_label.as_str())
        .x_labels(2 * n + 1)
        .x_label_formatter(&tick_label)
        .y_label_formatter(&y_label)
        .draw()
        .map_err(err)?;
    if vertical {
        // Rotated axis labels would be centred on their tick, half inside the chart: these
        // start under the axis and run down.
        let style = TextStyle::from(("sans-serif", 11))
            .transform(FontTransform::Rotate90)
            .pos(Pos::new(HPos::Left, VPos::Center));
        let (bx, by) = area.get_base_pixel();
        for (i, c) in panel.categories.iter().enumerate() {
            let (x, y) = chart.backend_coord(&(i as f64 + 0.5, lo));
            area.draw(&Text::new(label(c), (x - bx, y - by + 6), &style))
                .map_err(err)?;
        }
    }
    let k = panel.series.len();
    let bar = 0.8 / k as f64;
    let labelled = panel.kind == Kind::Bars && n * k <= MAX_LABELLED_BARS;
    let lift = (hi - lo) * 0.01;
    let above = TextStyle::from(("sans-serif", 10)).pos(Pos::new(HPos::Center, VPos::Bottom));
    for (j, s) in panel.series.iter().enumerate() {
        let colour = COLOURS[j];
        let points: Vec<(usize, f64)> = s
            .values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| Some((i, (*v)?)))
            .collect();
        if points.is_empty() {
            continue;
        }
        let anno = match panel.kind {
            Kind::Bars => {
                let x0 = |i: usize| i as f64 + 0.1 + bar * j as f64;
                if labelled {
                    chart
                        .draw_series(points.iter().map(|&(i, v)| {
                            Text::new(short(v), (x0(i) + bar / 2.0, v.max(0.0) + lift), &above)
                        }))
                        .map_err(err)?;
                }
                chart
                    .draw_series(points.iter().map(|&(i, v)| {
                        Rectangle::new([(x0(i), 0.0), (x0(i) + bar, v)], colour.filled())
                    }))
                    .map_err(err)?
            }
            Kind::Lines => {
                // A line through each run of consecutive values; a gap where one is missing.
                for run in points.chunk_by(|a, b| b.0 == a.0 + 1) {
                    chart
                        .draw_series(LineSeries::new(
                            run.iter().map(|&(i, v)| (i as f64 + 0.5, v)),
                            colour.stroke_width(2),
                        ))
                        .map_err(err)?;
                }
                chart
                    .draw_series(
                        points
                            .iter()
                            .map(|&(i, v)| Circle::new((i as f64 + 0.5, v), 4, colour.filled())),
                    )
                    .map_err(err)?
            }
        };
        anno.label(s.name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], colour.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cats(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    fn write(panels: &[Panel]) -> Result<String, PlotError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("figure.svg");
        write_svg(&path, "figure title (2 CPUs)", panels, 2)?;
        Ok(std::fs::read_to_string(&path).unwrap())
    }

    fn bars() -> Panel {
        Panel::new(
            Kind::Bars,
            "latency",
            "policy",
            "Submit to Grant (µs)",
            cats(&["none", "fair (lease)"]),
        )
        .with(Series::new("p50", vec![Some(4.5), None]))
        .with(Series::new("p99", vec![Some(40.0), Some(12.0)]))
    }

    #[test]
    fn bars_and_lines_carry_titles_axes_legend_and_values() {
        let lines = Panel::new(
            Kind::Lines,
            "throughput",
            "devices",
            "decisions/s",
            cats(&["16", "64", "256"]),
        )
        .with(Series::new(
            "none",
            vec![Some(33_700.0), Some(30_600.0), None],
        ))
        .with(Series::new(
            "fair",
            vec![Some(327_000.0), None, Some(383_000.0)],
        ));
        let svg = write(&[bars(), lines]).unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..40]);
        for text in [
            "figure title (2 CPUs)",
            "latency",
            "policy",
            "Submit to Grant (µs)",
            "fair (lease)",
            "p50",
            "p99",
            "throughput",
            "devices",
            "decisions/s",
            "256",
            "4.50",
            "40.0",
        ] {
            let escaped = text.replace('&', "&amp;");
            assert!(svg.contains(&escaped), "{text:?} missing");
        }
        // Three bars (one value missing) plus two legend swatches, and more besides.
        assert!(svg.matches("<rect").count() >= 5);
        // The fair line has a gap: two single points, no segment; none has one segment.
        assert!(svg.matches("<polyline").count() >= 1);
        assert!(svg.matches("<circle").count() >= 4);
    }

    #[test]
    fn bad_input_is_refused_and_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("no.svg");
        let refused = |panels: &[Panel]| {
            let e = write_svg(&path, "t", panels, 1).unwrap_err();
            assert!(!path.exists(), "{e}: a file was written");
            e
        };
        assert!(matches!(refused(&[]), PlotError::Shape(_)));
        let mut nan = bars();
        nan.series[1].values[1] = Some(f64::NAN);
        let e = refused(&[nan]);
        assert!(
            matches!(&e, PlotError::NotFinite { series, category, .. }
                if series == "p99" && category == "fair (lease)"),
            "{e}"
        );
        let mut inf = bars();
        inf.series[0].values[0] = Some(f64::INFINITY);
        assert!(matches!(refused(&[inf]), PlotError::NotFinite { .. }));
        let mut short_series = bars();
        short_series.series[0].values.pop();
        assert!(
            refused(&[short_series])
                .to_string()
                .contains("1 values for 2")
        );
        let mut empty = bars();
        for s in &mut empty.series {
            s.values = vec![None, None];
        }
        assert!(refused(&[empty]).to_string().contains("no values"));
        let mut none = bars();
        none.series.clear();
        assert!(matches!(refused(&[none]), PlotError::Shape(_)));
        let no_categories = Panel::new(Kind::Lines, "t", "x", "y", Vec::new());
        assert!(matches!(refused(&[no_categories]), PlotError::Shape(_)));
        assert!(matches!(
            refused(&vec![bars(); MAX_PANELS + 1]),
            PlotError::Shape(_)
        ));
    }

    #[test]
    fn negative_values_and_many_categories_are_drawn() {
        let names: Vec<String> = (0..33).map(|i| format!("[scene{i}] option=x")).collect();
        let many = Panel::new(Kind::Bars, "fps per scene", "scene", "frames/s", names).with(
            Series::new("a", (0..33).map(|i| Some(f64::from(i))).collect()),
        );
        let overhead = Panel::new(Kind::Bars, "overhead", "mode", "%", cats(&["a", "b"]))
            .with(Series::new("loss", vec![Some(-3.0), Some(8.0)]));
        let svg = write(&[many, overhead]).unwrap();
        assert!(svg.contains("[scene32] option=x") && svg.contains("-3.00"));
    }

    #[test]
    fn short_labels() {
        assert_eq!(short(383_000.0), "383k");
        assert_eq!(short(2_500_000.0), "2.5M");
        assert_eq!(short(123.4), "123");
        assert_eq!(short(12.34), "12.3");
        assert_eq!(short(1.234), "1.23");
        assert_eq!(short(10_830.0), "10.8k");
        assert_eq!(short(0.0434), "0.043");
        assert_eq!(short(0.0), "0");
    }
}
