//! The SVG plot: one row per run; the left panel shows each VM's GPU share over time, the
//! right one (when some VM renders frames) each frame VM's FPS over time.

use std::path::Path;

use plotters::prelude::*;
use vgpu_scheduler::sim::{RunReport, Scenario};

/// Pixel size of one panel.
const PANEL: (u32, u32) = (640, 300);

/// One panel: a line per VM that `pick` selects, its values from `values`.
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    run: &RunReport,
    caption: &str,
    y_desc: &str,
    pick: &dyn Fn(usize) -> bool,
    values: &dyn Fn(usize) -> Vec<f64>,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let t = &run.series.t_ms;
    let x_max = t.last().copied().unwrap_or(1.0).max(1.0);
    let lines: Vec<(usize, Vec<f64>)> = (0..run.vms.len())
        .filter(|&i| pick(i))
        .map(|i| (i, values(i)))
        .collect();
    let y_top = lines
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max);
    let y_max = (y_top * 1.1).max(1.0);
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(32)
        .y_label_area_size(48)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("time (ms)")
        .y_desc(y_desc)
        .draw()
        .map_err(err)?;
    for (i, v) in lines {
        let color = Palette99::pick(i).to_rgba();
        let points = t.iter().copied().zip(v);
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(run.vms[i].name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
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

/// Writes the scenario's plot to `path`.
pub(crate) fn svg(path: &Path, sc: &Scenario, runs: &[RunReport]) -> Result<(), String> {
    let frames = |r: &RunReport, i: usize| r.vms.get(i).is_some_and(|v| v.workload == "frames");
    let with_fps = runs.iter().any(|r| (0..r.vms.len()).any(|i| frames(r, i)));
    let cols: u32 = if with_fps { 2 } else { 1 };
    let rows = u32::try_from(runs.len().max(1)).unwrap_or(u32::MAX);
    let size = (
        PANEL.0 * cols,
        PANEL.1.saturating_mul(rows).saturating_add(40),
    );
    let root = SVGBackend::new(path, size).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(
            &format!("{}: {}", sc.name, sc.description),
            ("sans-serif", 18),
        )
        .map_err(err)?;
    let areas = root.split_evenly((rows as usize, cols as usize));
    for (k, run) in runs.iter().enumerate() {
        let base = k * cols as usize;
        let Some(left) = areas.get(base) else { break };
        let caption = format!("{} ({}): GPU share per interval", run.label, run.policy);
        let share = |i: usize| {
            run.series.vms[i]
                .gpu_share
                .iter()
                .map(|s| 100.0 * s)
                .collect()
        };
        panel(left, run, &caption, "GPU share (%)", &|_| true, &share)?;
        if let Some(right) = areas.get(base + 1).filter(|_| with_fps) {
            let caption = format!("{} ({}): frames per second", run.label, run.policy);
            let fps = |i: usize| run.series.vms[i].fps.clone();
            panel(right, run, &caption, "FPS", &|i| frames(run, i), &fps)?;
        }
    }
    root.present().map_err(err)?;
    Ok(())
}
