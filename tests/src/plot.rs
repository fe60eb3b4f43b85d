//! SVG charts the benchmarks write next to their JSON (plotters' SVG backend, no fonts or
//! image libraries needed).

use std::path::Path;

use plotters::prelude::*;

/// One series of a grouped bar chart: its name and a value per category (`None`: no bar).
#[derive(Debug, Clone)]
pub struct Series {
    /// The legend's name.
    pub name: String,
    /// A value per category.
    pub values: Vec<Option<f64>>,
}

/// Colours of the series, in order (repeating).
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Writes a grouped bar chart: one group of bars per category, one bar per series, with a
/// legend; categories are labelled below the axis (rotated when there are many).
pub fn grouped_bars(
    path: &Path,
    title: &str,
    y_label: &str,
    categories: &[String],
    series: &[Series],
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<std::io::Error>| e.to_string();
    let width = (160 + 26 * categories.len() * series.len().max(1)).clamp(640, 2400) as u32;
    let root = SVGBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let top = series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .fold(0.0f64, |a, &b| a.max(b));
    let top = if top > 0.0 { top * 1.15 } else { 1.0 };
    let n = categories.len().max(1);
    let long = categories.len() > 8;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(if long { 150 } else { 30 })
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)
        .map_err(err)?;
    let label = |x: &f64| {
        let i = x.floor() as usize;
        if (x - i as f64 - 0.5).abs() < 1e-6 {
            categories.get(i).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let mut mesh = chart.configure_mesh();
    mesh.disable_x_mesh()
        .y_desc(y_label)
        .x_labels(2 * n + 1)
        .x_label_formatter(&label);
    if long {
        mesh.x_label_style(
            ("sans-serif", 11)
                .into_font()
                .transform(FontTransform::Rotate90),
        );
    }
    mesh.draw().map_err(err)?;
    let k = series.len().max(1) as f64;
    let bar = 0.8 / k;
    for (j, s) in series.iter().enumerate() {
        let colour = COLOURS[j % COLOURS.len()];
        chart
            .draw_series(s.values.iter().enumerate().filter_map(|(i, v)| {
                let v = (*v)?;
                let x0 = i as f64 + 0.1 + bar * j as f64;
                Some(Rectangle::new([(x0, 0.0), (x0 + bar, v)], colour.filled()))
            }))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], colour.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_has_a_bar_per_value_and_the_legend() {
        let dir = crate::TempDir::new("vgpu-plot").unwrap();
        let path = dir.path().join("chart.svg");
        grouped_bars(
            &path,
            "fps",
            "frames/s",
            &["build".into(), "shading".into()],
            &[
                Series {
                    name: "ours".into(),
                    values: vec![Some(10.0), Some(20.0)],
                },
                Series {
                    name: "theirs".into(),
                    values: vec![Some(5.0), None],
                },
            ],
        )
        .unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        for text in ["ours", "theirs", "build", "shading", "frames/s"] {
            assert!(svg.contains(text), "{text} in the chart");
        }
        // Three bars plus two legend swatches, besides the background and frame.
        assert!(svg.matches("<rect").count() >= 5);
    }
}
