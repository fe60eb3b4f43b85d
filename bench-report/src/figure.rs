//! The figure of each benchmark, drawn from the JSON it wrote: the SVG goes next to the JSON
//! (same name, `.svg`). Benchmarks call [`write_for`] after writing their JSON; `vgpu-replot`
//! redraws recorded results the same way, so a figure always shows what its JSON says.
//!
//! The benchmark is recognised by the JSON's `bench` (or `benchmark`) field.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::plot::{Kind, Panel, PlotError, Series, write_svg};

/// Largest benchmark JSON read (gl_side_by_side's with every run is under 100 KiB).
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// Why a benchmark's figure was not written.
#[derive(Debug, thiserror::Error)]
pub enum FigureError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}: larger than {MAX_JSON_BYTES} bytes")]
    TooLarge(PathBuf),
    #[error("{path}: not JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("no figure for benchmark {0:?}")]
    Unknown(String),
    #[error("{bench}: {what} missing in the JSON")]
    Missing { bench: &'static str, what: String },
    #[error(transparent)]
    Plot(#[from] PlotError),
}

/// A figure: its title, panels and panels per row.
#[derive(Debug)]
pub struct Figure {
    pub title: String,
    pub panels: Vec<Panel>,
    pub columns: usize,
}

/// Environment variable naming where a benchmark of `vgpu-tests` writes its JSON instead of
/// its default path.
pub const OUT_ENV: &str = "VGPU_BENCH_OUT";

/// Where a benchmark writes its JSON: `$VGPU_BENCH_OUT` if set, else `default`.
pub fn out_path(default: &Path) -> PathBuf {
    std::env::var_os(OUT_ENV).map_or_else(|| default.to_owned(), PathBuf::from)
}

/// Writes a benchmark's results `doc` as JSON to `json` (creating its directory) and its
/// figure beside it, and prints both paths. A figure that cannot be drawn (a run that measured
/// nothing) is reported on stderr; the JSON is written regardless.
pub fn write_results(json: &Path, doc: &Value) -> Result<(), FigureError> {
    let write = |source| FigureError::Write {
        path: json.to_owned(),
        source,
    };
    if let Some(dir) = json.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(write)?;
    }
    std::fs::write(json, format!("{doc:#}\n")).map_err(write)?;
    println!("JSON: {}", json.display());
    match write_for(json) {
        Ok(svg) => println!("SVG: {}", svg.display()),
        Err(e) => eprintln!("no figure: {e}"),
    }
    Ok(())
}

/// Reads the benchmark JSON at `json`, writes its figure next to it and returns the SVG's path.
pub fn write_for(json: &Path) -> Result<PathBuf, FigureError> {
    let read = |source| FigureError::Read {
        path: json.to_owned(),
        source,
    };
    if std::fs::metadata(json).map_err(read)?.len() > MAX_JSON_BYTES {
        return Err(FigureError::TooLarge(json.to_owned()));
    }
    let text = std::fs::read_to_string(json).map_err(read)?;
    let doc: Value = serde_json::from_str(&text).map_err(|source| FigureError::Json {
        path: json.to_owned(),
        source,
    })?;
    let figure = figure(&doc)?;
    let svg = json.with_extension("svg");
    write_svg(&svg, &figure.title, &figure.panels, figure.columns)?;
    Ok(svg)
}

/// The figure of a benchmark's JSON document.
pub fn figure(doc: &Value) -> Result<Figure, FigureError> {
    let name = doc
        .get("bench")
        .or_else(|| doc.get("benchmark"))
        .and_then(Value::as_str)
        .unwrap_or("");
    match name {
        "grant" => grant(doc),
        "scale" => scale(doc),
        "doorbell" => doorbell(doc),
        "bar_read" => bar_read(doc),
        "sched_overhead" => sched_overhead(doc),
        "cuda-guest" => cuda_guest(doc),
        "cuda-remote" => cuda_remote(doc),
        "gl_side_by_side" => gl_side_by_side(doc),
        "piglit" => piglit(doc),
        "criterion" => criterion(doc),
        other => Err(FigureError::Unknown(other.to_owned())),
    }
}

fn num(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

fn text<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// The array `key` of `doc`, required to hold something.
fn rows<'a>(doc: &'a Value, bench: &'static str, key: &str) -> Result<&'a [Value], FigureError> {
    match doc.get(key).and_then(Value::as_array) {
        Some(a) if !a.is_empty() => Ok(a),
        _ => Err(FigureError::Missing {
            bench,
            what: format!("the array {key:?}"),
        }),
    }
}

/// The machine of the title: the JSON's `machine`, else its CPU count.
fn machine(doc: &Value) -> String {
    text(doc, "machine").map_or_else(
        || num(doc, "cpus").map_or("unknown machine".into(), |n| format!("{n} CPUs")),
        str::to_owned,
    )
}

/// Distinct values of `key` in `rows`, in first-seen order.
fn distinct(rows: &[Value], key: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in rows {
        let v = match r.get(key) {
            Some(Value::String(s)) => s.clone(),
            Some(v) => v.to_string(),
            None => continue,
        };
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

/// `row[key]` as the text [`distinct`] compares.
fn key_text(row: &Value, key: &str) -> Option<String> {
    match row.get(key)? {
        Value::String(s) => Some(s.clone()),
        v => Some(v.to_string()),
    }
}

/// One series per value of `series_key`, a value per category (`category_key`), read from
/// `value` of the row that has both.
fn pivot(
    rows: &[Value],
    categories: &[String],
    category_key: &str,
    series_key: &str,
    series_name: &dyn Fn(&str) -> String,
    value: &str,
) -> Vec<Series> {
    distinct(rows, series_key)
        .into_iter()
        .map(|s| {
            let values = categories
                .iter()
                .map(|c| {
                    rows.iter()
                        .find(|r| {
                            key_text(r, category_key).as_ref() == Some(c)
                                && key_text(r, series_key).as_ref() == Some(&s)
                        })
                        .and_then(|r| num(r, value))
                })
                .collect();
            Series::new(series_name(&s), values)
        })
        .collect()
}

/// Keeps the series that have a value.
fn with_values(series: Vec<Series>) -> Vec<Series> {
    series
        .into_iter()
        .filter(|s| s.values.iter().any(Option::is_some))
        .collect()
}

fn poll(us: &str) -> String {
    format!("busy poll {us} µs")
}

/// grant: Submit → Grant percentiles and the cost per group, per policy and busy polling.
fn grant(doc: &Value) -> Result<Figure, FigureError> {
    let rows = rows(doc, "grant", "policies")?;
    let policies = distinct(rows, "policy");
    let by_poll = |keys: &[(&str, &str)]| -> Vec<Series> {
        keys.iter()
            .flat_map(|&(key, what)| {
                pivot(
                    rows,
                    &policies,
                    "policy",
                    "busy_poll_us",
                    &|us| format!("{what}, {}", poll(us)),
                    key,
                )
            })
            .collect()
    };
    let latency = by_poll(&[("p50_us", "p50"), ("p99_us", "p99")]);
    let cost = by_poll(&[
        ("per_group_us", "wall"),
        ("daemon_cpu_per_group_us", "daemon CPU"),
    ]);
    let mut panels = vec![Panel {
        series: with_values(cost),
        ..Panel::new(
            Kind::Bars,
            "time per group (wall) and the daemon's CPU time per group",
            "policy",
            "µs per group",
            policies.clone(),
        )
    }];
    let latency = with_values(latency);
    if !latency.is_empty() {
        // Under leases there is no round trip: those policies have no bar here.
        panels.insert(
            0,
            Panel {
                series: latency,
                ..Panel::new(
                    Kind::Bars,
                    "Submit → Grant round trip (no bar: leased, no round trip)",
                    "policy",
                    "latency (µs)",
                    policies,
                )
            },
        );
    }
    Ok(Figure {
        title: format!(
            "grant round trip through vgpu-schedd, one fake device, {} groups × {} runs, medians — {}",
            num(doc, "groups").unwrap_or(0.0),
            num(doc, "runs").unwrap_or(0.0),
            machine(doc)
        ),
        panels,
        columns: 2,
    })
}

/// scale: decisions/s, grant p99 and the daemon's CPU against the number of devices.
fn scale(doc: &Value) -> Result<Figure, FigureError> {
    let rows = rows(doc, "scale", "configurations")?;
    let mut devices: Vec<u64> = rows
        .iter()
        .filter_map(|r| r.get("devices")?.as_u64())
        .collect();
    devices.sort_unstable();
    devices.dedup();
    let categories: Vec<String> = devices.iter().map(u64::to_string).collect();
    // Series: one per policy and busy polling.
    let series_of = |value: &str| -> Vec<Series> {
        let mut out = Vec::new();
        for policy in distinct(rows, "policy") {
            let of_policy: Vec<Value> = rows
                .iter()
                .filter(|r| text(r, "policy") == Some(policy.as_str()))
                .cloned()
                .collect();
            out.extend(pivot(
                &of_policy,
                &categories,
                "devices",
                "busy_poll_us",
                &|us| format!("{policy}, {}", poll(us)),
                value,
            ));
        }
        with_values(out)
    };
    let panel = |title: &str, y: &str, value: &str| Panel {
        series: series_of(value),
        ..Panel::new(
            Kind::Lines,
            title,
            "devices (each its own connection, submitting back to back)",
            y,
            categories.clone(),
        )
    };
    let panels: Vec<Panel> = [
        panel(
            "decisions per second",
            "groups/s (all devices)",
            "decisions_per_s",
        ),
        panel(
            "Submit → Grant p99 (queueing for one GPU; leased: none)",
            "latency (µs)",
            "grant_p99_us",
        ),
        panel(
            "the daemon's CPU time per decision",
            "µs per decision",
            "daemon_cpu_per_decision_us",
        ),
        panel("the daemon's CPU use", "% of one CPU", "daemon_cpu_percent"),
    ]
    .into_iter()
    .filter(|p| !p.series.is_empty())
    .collect();
    Ok(Figure {
        title: format!(
            "vgpu-schedd at scale: fake devices for {} s per configuration — {}",
            num(doc, "seconds").unwrap_or(0.0),
            machine(doc)
        ),
        panels,
        columns: 2,
    })
}

/// One path of the doorbell benchmark: its latency percentiles (µs) and notify rate.
struct DoorbellPath {
    name: String,
    p50: Option<f64>,
    p99: Option<f64>,
    rate: Option<f64>,
}

/// doorbell: latency percentiles and notify rates per path.
fn doorbell(doc: &Value) -> Result<Figure, FigureError> {
    let mut paths: Vec<DoorbellPath> = Vec::new();
    if let Some(q) = doc.get("qtest") {
        let l = q.get("write_to_used_us");
        paths.push(DoorbellPath {
            name: "QEMU qtest".into(),
            p50: l.and_then(|l| num(l, "p50")),
            p99: l.and_then(|l| num(l, "p99")),
            rate: num(q, "notify_writes_per_s"),
        });
    }
    for r in doc
        .get("server_only")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let l = r.get("notify_to_msix_us");
        paths.push(DoorbellPath {
            name: format!(
                "server, {}",
                poll(&num(r, "busy_poll_us").unwrap_or(0.0).to_string())
            ),
            p50: l.and_then(|l| num(l, "p50")),
            p99: l.and_then(|l| num(l, "p99")),
            rate: num(r, "notify_writes_per_s"),
        });
    }
    for r in doc
        .get("tcg_guest")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        paths.push(DoorbellPath {
            name: format!(
                "TCG guest, {}",
                poll(&num(r, "busy_poll_us").unwrap_or(0.0).to_string())
            ),
            p50: num(r, "p50_us"),
            p99: num(r, "p99_us"),
            rate: None,
        });
    }
    if paths.is_empty() {
        return Err(FigureError::Missing {
            bench: "doorbell",
            what: "every section (qtest, server_only, tcg_guest)".into(),
        });
    }
    let names: Vec<String> = paths.iter().map(|p| p.name.clone()).collect();
    let mut panels = vec![
        Panel::new(
            Kind::Bars,
            "one doorbell: qtest write → used, server notify → MSI-X, guest submit → fence",
            "path",
            "latency (µs)",
            names.clone(),
        )
        .with(Series::new("p50", paths.iter().map(|p| p.p50).collect()))
        .with(Series::new("p99", paths.iter().map(|p| p.p99).collect())),
    ];
    let rated: Vec<&DoorbellPath> = paths.iter().filter(|p| p.rate.is_some()).collect();
    if !rated.is_empty() {
        panels.push(
            Panel::new(
                Kind::Bars,
                "posted notify writes taken per second",
                "path",
                "notify writes/s",
                rated.iter().map(|p| p.name.clone()).collect(),
            )
            .with(Series::new(
                "notify writes/s",
                rated.iter().map(|p| p.rate).collect(),
            )),
        );
    }
    Ok(Figure {
        title: format!(
            "doorbell: {} — {}",
            text(doc, "qemu").unwrap_or("no QEMU"),
            machine(doc)
        ),
        panels,
        columns: 2,
    })
}

/// bar_read: the REGION_READ round trip's percentiles.
fn bar_read(doc: &Value) -> Result<Figure, FigureError> {
    let keys = [("p50", "p50_us"), ("p99", "p99_us"), ("mean", "mean_us")];
    let values: Vec<Option<f64>> = keys.iter().map(|(_, k)| num(doc, k)).collect();
    Ok(Figure {
        title: format!(
            "BAR read round trip, raw vfio-user client → vgpu-server, {} reads — {}",
            num(doc, "reads").unwrap_or(0.0),
            machine(doc)
        ),
        panels: vec![
            Panel::new(
                Kind::Bars,
                "REGION_READ of the device status to its reply",
                "statistic",
                "latency (µs)",
                keys.iter().map(|(n, _)| (*n).to_owned()).collect(),
            )
            .with(Series::new("round trip", values)),
        ],
        columns: 1,
    })
}

/// sched_overhead: overhead per mode (raw client, and the guest's glmark2 when measured),
/// latency and rate per mode.
fn sched_overhead(doc: &Value) -> Result<Figure, FigureError> {
    let raw = rows(doc, "sched_overhead", "modes")?;
    let guest = doc
        .get("guest_glmark2_build")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let modes = distinct(raw, "mode");
    let of = |rows: &[Value], key: &str| -> Vec<Option<f64>> {
        modes
            .iter()
            .map(|m| {
                rows.iter()
                    .find(|r| text(r, "mode") == Some(m.as_str()))
                    .and_then(|r| num(r, key))
            })
            .collect()
    };
    let occupy = num(doc, "occupy_us").unwrap_or(0.0);
    let mut overhead = Panel::new(
        Kind::Bars,
        "overhead against no daemon",
        "mode",
        "throughput lost (%)",
        modes.clone(),
    )
    .with(Series::new(
        format!("raw client, {occupy} µs groups"),
        of(raw, "overhead_pct"),
    ));
    let virgl = doc
        .get("virgl_modes")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let virgl_added = of(virgl, "added_us_per_group");
    let guest_fps = of(guest, "fps");
    if guest_fps.iter().any(Option::is_some) {
        overhead = overhead.with(Series::new(
            "TCG guest, glmark2 build",
            of(guest, "overhead_pct"),
        ));
    }
    let mut panels = vec![
        overhead,
        Panel::new(
            Kind::Bars,
            format!("raw client: submit → fence of a {occupy} µs group"),
            "mode",
            "latency (µs)",
            modes.clone(),
        )
        .with(Series::new("p50", of(raw, "p50_us")))
        .with(Series::new("p99", of(raw, "p99_us"))),
        Panel::new(
            Kind::Bars,
            "raw client: groups per second",
            "mode",
            "groups/s",
            modes.clone(),
        )
        .with(Series::new("groups/s", of(raw, "groups_per_s"))),
    ];
    if virgl_added.iter().any(Option::is_some) {
        panels.push(
            Panel::new(
                Kind::Bars,
                "raw client: virgl submits (device-executed, fenced)",
                "mode",
                "µs added per group",
                modes.clone(),
            )
            .with(Series::new("against no daemon", virgl_added)),
        );
    }
    if guest_fps.iter().any(Option::is_some) {
        panels.push(
            Panel::new(
                Kind::Bars,
                "TCG guest: glmark2 build scene, off-screen",
                "mode",
                "frames/s",
                modes,
            )
            .with(Series::new("glmark2 build", guest_fps)),
        );
    }
    Ok(Figure {
        title: format!(
            "scheduling overhead per mode, medians of runs — {}",
            machine(doc)
        ),
        panels,
        columns: 2,
    })
}

/// cuda_guest: the driver benchmark in a TCG guest against the host.
fn cuda_guest(doc: &Value) -> Result<Figure, FigureError> {
    let sides = [
        ("TCG guest through the vGPU", "guest"),
        ("host over a socket", "host"),
    ];
    for (_, key) in sides {
        if doc.get(key).is_none() {
            return Err(FigureError::Missing {
                bench: "cuda-guest",
                what: format!("the object {key:?}"),
            });
        }
    }
    let panel = |title: &str, y: &str, keys: &[(&str, &str)]| {
        sides.iter().fold(
            Panel::new(
                Kind::Bars,
                title,
                "measure",
                y,
                keys.iter().map(|(n, _)| (*n).to_owned()).collect(),
            ),
            |p, (name, side)| {
                p.with(Series::new(
                    *name,
                    keys.iter().map(|(_, k)| num(&doc[side], k)).collect(),
                ))
            },
        )
    };
    Ok(Figure {
        title: format!(
            "CUDA driver_bench on our libcuda, {} launches, {} MiB copies — {}",
            num(doc, "launches").unwrap_or(0.0),
            num(doc, "copy_mib").unwrap_or(0.0),
            machine(doc)
        ),
        panels: vec![
            panel(
                "empty kernel launch to completion",
                "µs per launch",
                &[
                    ("launch p50", "launch_p50_us"),
                    ("launch p99", "launch_p99_us"),
                    ("batched, per launch", "batched_launch_us"),
                ],
            ),
            panel(
                "copies",
                "GiB/s",
                &[
                    ("host → device", "htod_gib_s"),
                    ("device → host", "dtoh_gib_s"),
                ],
            ),
        ],
        columns: 2,
    })
}

/// cuda-remote: the guest library over a socket against the backend called directly.
fn cuda_remote(doc: &Value) -> Result<Figure, FigureError> {
    let sides = [
        ("guest library → socket → backend", "remote"),
        ("backend direct", "direct"),
    ];
    let side = |key: &str| {
        doc.get(key).ok_or_else(|| FigureError::Missing {
            bench: "cuda-remote",
            what: format!("the object {key:?}"),
        })
    };
    let mut launch = Panel::new(
        Kind::Bars,
        "empty kernel launch to completion",
        "statistic",
        "µs per launch",
        ["p50", "p99", "mean"].map(str::to_owned).to_vec(),
    );
    let mut copies = Panel::new(
        Kind::Bars,
        "copies",
        "direction",
        "GiB/s",
        ["host → device", "device → host"]
            .map(str::to_owned)
            .to_vec(),
    );
    for (name, key) in sides {
        let s = side(key)?;
        let l = s.get("launch");
        launch = launch.with(Series::new(
            name,
            ["p50_us", "p99_us", "mean_us"]
                .iter()
                .map(|k| l.and_then(|l| num(l, k)))
                .collect(),
        ));
        copies = copies.with(Series::new(
            name,
            vec![num(s, "htod_gib_s"), num(s, "dtoh_gib_s")],
        ));
    }
    Ok(Figure {
        title: format!(
            "CUDA remoting over a Unix socket, backend {}, {} launches — {}",
            text(doc, "backend").unwrap_or("?"),
            num(doc, "launches").unwrap_or(0.0),
            machine(doc)
        ),
        panels: vec![launch, copies],
        columns: 2,
    })
}

/// gl_side_by_side: the suite scores and kmscube per device, and glmark2's scenes.
fn gl_side_by_side(doc: &Value) -> Result<Figure, FigureError> {
    let devices = rows(doc, "gl_side_by_side", "devices")?;
    let median = |d: &Value, key: &str| d.get(key).and_then(|v| num(v, "median"));
    let measures = [
        ("glmark2 off-screen score", "glmark2_off_screen"),
        ("glmark2 on-screen score", "glmark2_on_screen"),
        ("kmscube fps", "kmscube_fps"),
    ];
    let name = |d: &Value| text(d, "device").unwrap_or("?").to_owned();
    let overall = devices.iter().fold(
        Panel::new(
            Kind::Bars,
            "whole runs",
            "measure",
            "score / frames per second",
            measures.iter().map(|(n, _)| (*n).to_owned()).collect(),
        ),
        |p, d| {
            p.with(Series::new(
                name(d),
                measures.iter().map(|(_, k)| median(d, k)).collect(),
            ))
        },
    );
    let mut scenes: Vec<String> = devices
        .iter()
        .filter_map(|d| d.get("off_screen_scene_fps")?.as_object())
        .flat_map(|m| m.keys().cloned())
        .collect();
    scenes.sort();
    scenes.dedup();
    let mut panels = vec![Panel {
        series: with_values(overall.series),
        ..overall
    }];
    let per_scene = devices.iter().fold(
        Panel::new(
            Kind::Bars,
            "glmark2 off-screen, per scene",
            "scene",
            "frames/s",
            scenes.clone(),
        ),
        |p, d| {
            let fps = d.get("off_screen_scene_fps");
            p.with(Series::new(
                name(d),
                scenes.iter().map(|s| fps.and_then(|f| num(f, s))).collect(),
            ))
        },
    );
    if !scenes.is_empty() {
        panels.push(Panel {
            series: with_values(per_scene.series),
            ..per_scene
        });
    }
    Ok(Figure {
        title: format!(
            "GL side by side at {}, medians of {} runs per device: {} — {}, {}",
            text(doc, "mode").unwrap_or("?"),
            num(doc, "runs_per_device").unwrap_or(0.0),
            text(doc, "qemu").unwrap_or("?"),
            machine(doc),
            text(doc, "accelerator").unwrap_or("?")
        ),
        panels,
        columns: 1,
    })
}

/// piglit: the passing share of each group of the selection, a bar per device.
fn piglit(doc: &Value) -> Result<Figure, FigureError> {
    let devices = rows(doc, "piglit", "devices")?;
    let groups: Vec<String> = doc
        .get("groups")
        .and_then(Value::as_array)
        .map(|g| {
            g.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    let mut categories = groups.clone();
    categories.push("all".to_owned());
    let share = |counts: Option<&Value>| {
        let counts = counts?.as_object()?;
        let total: f64 = counts.values().filter_map(Value::as_f64).sum();
        let pass = ["pass", "warn"]
            .iter()
            .filter_map(|k| counts.get(*k)?.as_f64())
            .sum::<f64>();
        (total > 0.0).then(|| 100.0 * pass / total)
    };
    let panel = devices.iter().fold(
        Panel::new(
            Kind::Bars,
            "tests passing, per group",
            "group",
            "pass (%)",
            categories,
        ),
        |p, d| {
            let mut values: Vec<Option<f64>> = groups
                .iter()
                .map(|g| share(d.get("groups").and_then(|m| m.get(g))))
                .collect();
            values.push(share(d.get("counts")));
            p.with(Series::new(text(d, "device").unwrap_or("?"), values))
        },
    );
    Ok(Figure {
        title: format!(
            "piglit, {} tests of tests/piglit/selection.txt: {} — {}, {}",
            num(doc, "tests").unwrap_or(0.0),
            text(doc, "qemu").unwrap_or("?"),
            machine(doc),
            text(doc, "accel").unwrap_or("?")
        ),
        panels: vec![Panel {
            series: with_values(panel.series),
            ..panel
        }],
        columns: 1,
    })
}

/// A criterion summary ([`crate::criterion`]): the mean per benchmark, a line per series when
/// the parameters are numbers (vGPUs, devices), bars otherwise.
fn criterion(doc: &Value) -> Result<Figure, FigureError> {
    let rows = rows(doc, "criterion", "estimates")?;
    let mut categories = distinct(rows, "category");
    let numbers: Option<Vec<f64>> = categories.iter().map(|c| c.parse().ok()).collect();
    let kind = match numbers {
        Some(mut n) => {
            n.sort_by(f64::total_cmp);
            categories = n.iter().map(f64::to_string).collect();
            Kind::Lines
        }
        None => Kind::Bars,
    };
    // Means in the summary's unit (ns unless it says otherwise); categories compared as
    // numbers when they are.
    let unit = num(doc, "unit_ns")
        .filter(|u| u.is_finite() && *u > 0.0)
        .unwrap_or(1.0);
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if kind == Kind::Lines
                && let Some(n) = text(&r, "category").and_then(|c| c.parse::<f64>().ok())
            {
                r["category"] = Value::String(n.to_string());
            }
            if let Some(ns) = num(&r, "mean_ns") {
                r["mean"] = Value::from(ns / unit);
            }
            r
        })
        .collect();
    let series = pivot(
        &rows,
        &categories,
        "category",
        "series",
        &str::to_owned,
        "mean",
    );
    Ok(Figure {
        title: text(doc, "title").unwrap_or("criterion").to_owned(),
        panels: vec![Panel {
            series,
            ..Panel::new(
                kind,
                "mean time per iteration (criterion)",
                text(doc, "x_label").unwrap_or("benchmark"),
                text(doc, "y_label").unwrap_or("ns per iteration"),
                categories,
            )
        }],
        columns: 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Writes `doc` as `name`.json in a temporary directory, draws it, returns the SVG.
    fn drawn(name: &str, doc: &Value) -> String {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("out").join(format!("{name}.json"));
        write_results(&json, doc).unwrap();
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(&back, doc);
        std::fs::read_to_string(json.with_extension("svg")).unwrap()
    }

    fn has(svg: &str, texts: &[&str]) {
        for t in texts {
            assert!(svg.contains(t), "{t:?} missing");
        }
    }

    #[test]
    fn grant_and_scale() {
        let row = |policy: &str, poll: u64, p50: Option<f64>| {
            json!({"policy": policy, "busy_poll_us": poll, "p50_us": p50, "p99_us": p50.map(|p| p * 9.0),
                   "per_group_us": 12.0, "daemon_cpu_per_group_us": 3.0})
        };
        let svg = drawn(
            "grant-bench",
            &json!({"bench": "grant", "groups": 5000, "runs": 3, "machine": "2 CPUs (X)", "policies": [
                row("none", 0, Some(4.0)), row("none", 200, Some(5.0)),
                row("fair (lease)", 0, None), row("fair (lease)", 200, None)]}),
        );
        has(
            &svg,
            &[
                "2 CPUs (X)",
                "latency (µs)",
                "p99, busy poll 200 µs",
                "daemon CPU, busy poll 0 µs",
                "fair (lease)",
            ],
        );
        let conf = |policy: &str, devices: u64, poll: u64| {
            json!({"policy": policy, "devices": devices, "busy_poll_us": poll, "decisions_per_s": 30000.0 / devices as f64,
                   "grant_p99_us": null, "daemon_cpu_per_decision_us": 14.0, "daemon_cpu_percent": 48.0})
        };
        let svg = drawn(
            "scale-bench",
            &json!({"bench": "scale", "seconds": 3, "cpus": 2, "configurations": [
                conf("none", 256, 0), conf("none", 16, 0), conf("none", 64, 0), conf("none", 16, 200)]}),
        );
        has(
            &svg,
            &[
                "2 CPUs",
                "decisions per second",
                "groups/s (all devices)",
                "none, busy poll 200 µs",
                "256",
            ],
        );
        // Every grant p99 is null: that panel is left out, not drawn empty.
        assert!(!svg.contains("Submit → Grant p99"));
        assert!(svg.find("\n16\n").unwrap() < svg.find("\n256\n").unwrap());
    }

    #[test]
    fn piglit_shares_per_group() {
        let counts =
            |pass: u64, fail: u64| json!({"pass": pass, "warn": 0, "fail": fail, "skip": 0});
        let svg = drawn(
            "piglit-bench",
            &json!({"bench": "piglit", "tests": 11, "qemu": "QEMU 11", "machine": "2 CPUs (X)",
                    "accel": "tcg", "groups": ["core-gl", "gles"], "devices": [
                {"device": "vgpu-prefix", "counts": counts(10, 1), "groups": {"core-gl": counts(3, 0), "gles": counts(2, 1)}},
                {"device": "qemu-virtio-gpu-gl", "counts": counts(0, 0), "groups": {}}]}),
        );
        has(
            &svg,
            &["vgpu-prefix", "pass (%)", "core-gl", "all", "11 tests"],
        );
        // A device without results draws no bars and no legend entry.
        assert!(!svg.contains("qemu-virtio-gpu-gl"));
        assert!(figure(&json!({"bench": "piglit", "devices": []})).is_err());
    }

    /// The shapes the guest benchmarks recorded (values from a run on 2 CPUs).
    #[test]
    fn recorded_benchmarks() {
        let doorbell = json!({"benchmark":"doorbell","qemu":"QEMU emulator version 11.1.3","machine":"2 CPUs (Xeon), accelerator qtest",
            "qtest":{"notify_writes_per_s":19806,"write_to_used_us":{"p50":154.28,"p99":308.39,"mean":161.48,"max":4794.83},"round_trip_us":69.37},
            "server_only":[{"busy_poll_us":0,"notify_writes_per_s":372450,"notify_to_msix_us":{"p50":70.88,"p99":347.18}},
                           {"busy_poll_us":200,"notify_writes_per_s":422687,"notify_to_msix_us":{"p50":12.20,"p99":46.89}}],
            "tcg_guest":[{"busy_poll_us":0,"p50_us":236,"p99_us":620,"groups_per_s":3070.0}]});
        has(
            &drawn("doorbell", &doorbell),
            &[
                "server, busy poll 200 µs",
                "TCG guest, busy poll 0 µs",
                "12.2",
                "423k",
                "notify writes/s",
            ],
        );
        let server_only = json!({"benchmark":"doorbell","machine":"m","server_only":[{"busy_poll_us":0,"notify_writes_per_s":1.0,"notify_to_msix_us":{"p50":1.0,"p99":2.0}}]});
        has(&drawn("doorbell-server", &server_only), &["no QEMU"]);
        let mode = |m: &str, o: f64| json!({"mode": m, "groups_per_s": 9000.0, "p50_us": 102.1, "p99_us": 176.3, "overhead_pct": o});
        let sched = json!({"bench":"sched_overhead","occupy_us":50,"modes":[mode("no daemon", 0.0), mode("fair (lease)", 31.0)],
            "virgl_modes":[{"mode":"no daemon","added_us_per_group":0.0},{"mode":"fair (lease)","added_us_per_group":4.0}],
            "guest_glmark2_build":[{"mode":"no daemon","fps":336.0,"overhead_pct":0.0},{"mode":"fair (lease)","fps":320.0,"overhead_pct":5.0}]});
        has(
            &drawn("sched_overhead", &sched),
            &[
                "TCG guest, glmark2 build",
                "raw client, 50 µs groups",
                "throughput lost (%)",
                "frames/s",
                "µs added per group",
            ],
        );
        let cuda = json!({"benchmark":"cuda-guest","cpus":2,"launches":2000,"copy_mib":16,
            "guest":{"launch_p50_us":349.6,"launch_p99_us":882.8,"batched_launch_us":7.14,"htod_gib_s":0.043,"dtoh_gib_s":0.316},
            "host":{"launch_p50_us":69.7,"launch_p99_us":112.2,"batched_launch_us":2.65,"htod_gib_s":0.254,"dtoh_gib_s":0.587}});
        has(
            &drawn("cuda-guest", &cuda),
            &[
                "TCG guest through the vGPU",
                "host over a socket",
                "GiB/s",
                "µs per launch",
            ],
        );
        let gl = json!({"benchmark":"gl_side_by_side","qemu":"QEMU 11.1.3","machine":"2 CPUs","accelerator":"tcg","mode":"1024x768","runs_per_device":3,
            "devices":[{"device":"vgpu","glmark2_off_screen":{"median":232.0},"glmark2_on_screen":{"median":212.0},"kmscube_fps":{"median":671.0},
                        "off_screen_scene_fps":{"[build] use-vbo=false":300.0,"[texture] texture-filter=nearest":900.0}},
                       {"device":"vhost-user-gpu","glmark2_off_screen":null,"glmark2_on_screen":null,"kmscube_fps":null,"off_screen_scene_fps":{}}]});
        let svg = drawn("gl_side_by_side", &gl);
        has(
            &svg,
            &[
                "glmark2 off-screen score",
                "[texture] texture-filter=nearest",
                "vgpu",
            ],
        );
        // A device without figures has no legend entry.
        assert!(!svg.contains("vhost-user-gpu"));
        let remote = json!({"benchmark":"cuda-remote","backend":"cpu","cpus":2,"launches":2000,
            "remote":{"launch":{"p50_us":60.0,"p99_us":90.0,"mean_us":65.0},"htod_gib_s":0.5,"dtoh_gib_s":0.6},
            "direct":{"launch":{"p50_us":3.0,"p99_us":5.0,"mean_us":3.2},"htod_gib_s":5.0,"dtoh_gib_s":6.0}});
        has(
            &drawn("cuda-remote", &remote),
            &[
                "backend direct",
                "guest library → socket → backend",
                "µs per launch",
                "GiB/s",
            ],
        );
        let bar = json!({"bench":"bar_read","reads":50000,"machine":"m","p50_us":9.5,"p99_us":30.0,"mean_us":11.0});
        has(
            &drawn("bar_read", &bar),
            &["round trip", "9.50", "REGION_READ"],
        );
    }

    #[test]
    fn unknown_or_broken_json_is_refused() {
        assert!(matches!(
            figure(&json!({"bench": "nope"})),
            Err(FigureError::Unknown(n)) if n == "nope"
        ));
        assert!(matches!(
            figure(&json!({"bench": "grant", "policies": []})),
            Err(FigureError::Missing { .. })
        ));
        assert!(matches!(
            figure(&json!({"benchmark": "doorbell"})),
            Err(FigureError::Missing { .. })
        ));
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{not json").unwrap();
        assert!(matches!(write_for(&bad), Err(FigureError::Json { .. })));
        assert!(matches!(
            write_for(&dir.path().join("absent.json")),
            Err(FigureError::Read { .. })
        ));
        // Values that are all missing: nothing is drawn.
        let empty = dir.path().join("empty.json");
        std::fs::write(&empty, r#"{"bench":"bar_read"}"#).unwrap();
        assert!(matches!(write_for(&empty), Err(FigureError::Plot(_))));
        assert!(!dir.path().join("empty.svg").exists());
    }
}
