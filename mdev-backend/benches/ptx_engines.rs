//! The PTX engines against C, per corpus kernel (`compute::corpus_kernels::KERNELS`: every
//! kernel the nvcc corpus launches, with its program's own data; run
//! qemu-scripts/cuda-corpus.sh first, VGPU_CUDA_CORPUS names another corpus directory): the
//! time per launch on the interpreter, as compiled code, and as the C version of the same
//! kernel (`benches/ptx_c`, built with `gcc -O2` at the start; without gcc that column is left
//! out, saying so), each on 1 and 2 host threads (the C version spreads blocks over pthreads
//! from a shared counter, as the executor does). Also the compile time of each kernel: its
//! first compiled launch on a fresh module less the median compiled launch.
//!
//! Each time is the median of repeated launches on one setup (the buffers keep what the
//! previous launch wrote). The C version's first launch is checked against the interpreter's
//! buffers (`c_matches` in the JSON). Writes `target/ptx-engines.json` and its figure
//! `.svg` (the ratios interpreter/compiled and compiled/C per kernel), and prints the table of
//! docs/PERFORMANCE.md.
//!
//! `cargo bench -p mdev-backend --bench ptx_engines [-- FILTER]` (FILTER: a part of
//! `program/kernel`).

use std::collections::HashMap;
use std::ffi::c_void;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use mdev_backend::compute::corpus::corpus_dir;
use mdev_backend::compute::corpus_kernels::{
    self, Arg, CorpusKernel, KERNELS, launch_setup, program_ptx, setup,
};
use mdev_backend::compute::ptx::{Engine, Module};
use vgpu_bench_report::{Kind, Panel, Series, stats::median};

/// Time spent measuring one kernel on one engine and thread count, after a warm-up launch.
const MEASURE: Duration = Duration::from_millis(300);
/// Fewest timed launches per measurement (the slowest interpreted kernels take a second).
const MIN_RUNS: usize = 3;
/// Most timed launches per measurement.
const MAX_RUNS: usize = 500;
/// The host thread counts measured.
const THREADS: [usize; 2] = [1, 2];
/// Most buffers and scalar arguments a C kernel takes (`launch.h`'s `Launch`).
const C_BUFFERS: usize = 6;
const C_INTS: usize = 4;
const C_FLOATS: usize = 2;

/// `launch.h`'s `Launch`.
#[repr(C)]
struct CLaunch {
    grid: [u32; 3],
    block: [u32; 3],
    buf: [*mut c_void; C_BUFFERS],
    i: [i64; C_INTS],
    f: [f32; C_FLOATS],
}

/// A C kernel: `int name(const Launch*, unsigned threads)`, returning the threads it ran on.
type CKernel = unsafe extern "C" fn(*const CLaunch, u32) -> i32;

/// The C kernels, built into a temporary directory (removed when dropped).
struct CKernels {
    lib: libloading::Library,
    dir: PathBuf,
}

impl Drop for CKernels {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl CKernels {
    /// Builds `benches/ptx_c/*.c` with `gcc -O2 -shared -fPIC`; `None` (saying why) without
    /// gcc or when the build fails.
    fn build() -> Option<CKernels> {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/ptx_c");
        let dir = std::env::temp_dir().join(format!("vgpu-ptx-c-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let so = dir.join("libptxc.so");
        let mut sources: Vec<PathBuf> = std::fs::read_dir(&src)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "c"))
            .collect();
        sources.sort();
        let built = Command::new("gcc")
            .args(["-O2", "-shared", "-fPIC", "-o"])
            .arg(&so)
            .args(&sources)
            .args(["-lm", "-lpthread"])
            .status();
        match built {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("gcc failed ({s}): no C column");
                return None;
            }
            Err(e) => {
                eprintln!("no gcc ({e}): no C column");
                return None;
            }
        }
        // SAFETY: the library is ours, just built from benches/ptx_c; its initialisers are
        // the C runtime's alone.
        match unsafe { libloading::Library::new(&so) } {
            Ok(lib) => Some(CKernels { lib, dir }),
            Err(e) => {
                eprintln!("loading {}: {e}: no C column", so.display());
                None
            }
        }
    }

    /// The C version of `kernel` (its source name), if there is one.
    fn get(&self, kernel: &str) -> Option<CKernel> {
        // SAFETY: every exported function of the library has `CKernel`'s signature (the
        // KERNEL macro of launch.h defines them all).
        unsafe { self.lib.get::<CKernel>(kernel.as_bytes()) }
            .ok()
            .map(|f| *f)
    }
}

/// A kernel's buffers as host memory for its C version: 16-byte aligned (`float4`).
struct HostBuffers {
    words: Vec<Vec<u128>>,
    lens: Vec<usize>,
}

impl HostBuffers {
    fn new(contents: &[Vec<u8>]) -> HostBuffers {
        let words = contents
            .iter()
            .map(|c| {
                c.chunks(16)
                    .map(|chunk| {
                        let mut w = [0; 16];
                        w[..chunk.len()].copy_from_slice(chunk);
                        u128::from_le_bytes(w)
                    })
                    .collect()
            })
            .collect();
        HostBuffers {
            words,
            lens: contents.iter().map(Vec::len).collect(),
        }
    }

    fn bytes(&self) -> Vec<Vec<u8>> {
        self.words
            .iter()
            .zip(&self.lens)
            .map(|(w, &len)| {
                let mut b: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
                b.truncate(len);
                b
            })
            .collect()
    }

    /// The C launch of `k` over these buffers; `None` when it takes more arguments than
    /// `launch.h` has room for, or a texture or surface object.
    fn launch(&mut self, k: &CorpusKernel) -> Option<CLaunch> {
        let mut l = CLaunch {
            grid: k.grid,
            block: k.block,
            buf: [std::ptr::null_mut(); C_BUFFERS],
            i: [0; C_INTS],
            f: [0.0; C_FLOATS],
        };
        let (mut ints, mut floats) = (0, 0);
        for a in k.args {
            match *a {
                Arg::Buffer(b) => {
                    *l.buf.get_mut(b)? = self.words.get_mut(b)?.as_mut_ptr().cast();
                }
                Arg::Int(v) => {
                    *l.i.get_mut(ints)? = v;
                    ints += 1;
                }
                Arg::F32(v) => {
                    *l.f.get_mut(floats)? = v;
                    floats += 1;
                }
                Arg::Object { .. } => return None,
            }
        }
        Some(l)
    }
}

/// The median seconds per call of `f`, after one warm-up call.
fn per_launch(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < MIN_RUNS || (start.elapsed() < MEASURE && times.len() < MAX_RUNS) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    median(times)
}

/// One kernel's measurements: seconds per launch per thread count (`None`: not measured).
#[derive(Debug, Default)]
struct Row {
    name: String,
    interpreter: Vec<Option<f64>>,
    compiled: Vec<Option<f64>>,
    c: Vec<Option<f64>>,
    /// Whether compiled code ran it (else `Engine::Compiled` fell back to the interpreter).
    ran_compiled: bool,
    /// Seconds of the first compiled launch on a fresh module less the median launch's.
    compile: Option<f64>,
    c_matches: Option<bool>,
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    Some(a? / b?).filter(|r| r.is_finite())
}

fn geomean(v: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let logs: Vec<f64> = v.flatten().map(f64::ln).collect();
    (!logs.is_empty()).then(|| (logs.iter().sum::<f64>() / logs.len() as f64).exp())
}

fn measure(module: &Module, ptx: &str, k: &CorpusKernel, c: Option<&CKernels>) -> Row {
    let name = k.name();
    let s = setup(module, k).unwrap_or_else(|e| panic!("{name}: {e}"));
    let launch = |engine, threads| {
        launch_setup(module, &s, engine, threads).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let mut row = Row {
        name: name.clone(),
        ran_compiled: launch(Engine::Compiled, 1).compiled,
        ..Row::default()
    };
    // The first compiled launch on a fresh module: compiling and running it.
    let first_compiled = row.ran_compiled.then(|| {
        let fresh = Module::parse(ptx).expect("parse");
        let s = setup(&fresh, k).expect("setup");
        let t = Instant::now();
        launch_setup(&fresh, &s, Engine::Compiled, 1).expect("launch");
        t.elapsed().as_secs_f64()
    });
    let blocks = (k.grid[0] * k.grid[1]) as usize;
    let c_kernel = c.and_then(|c| c.get(k.kernel));
    let mut host = HostBuffers::new(&(k.buffers)());
    let c_launch = c_kernel.and_then(|f| Some((f, host.launch(k)?)));
    if let Some((f, l)) = &c_launch {
        // SAFETY: `l` points at `host`'s buffers, each as large as the kernel's device buffer
        // and aligned to 16 bytes, alive and not otherwise used across the call.
        let ran = unsafe { f(l, 1) };
        assert_eq!(ran, 1, "{name}: C threads");
        let reference = corpus_kernels::run(module, k, Engine::Interpreter, 1).expect("run");
        row.c_matches = Some(host.bytes() == reference.buffers);
    }
    for threads in THREADS {
        row.interpreter.push(Some(per_launch(|| {
            drop(launch(Engine::Interpreter, threads))
        })));
        row.compiled.push(
            row.ran_compiled
                .then(|| per_launch(|| drop(launch(Engine::Compiled, threads)))),
        );
        row.c.push(c_launch.as_ref().map(|(f, l)| {
            per_launch(|| {
                // SAFETY: as above.
                let ran = unsafe { f(l, threads as u32) };
                assert_eq!(ran as usize, threads.min(blocks), "{name}: C threads");
            })
        }));
    }
    row.compile = first_compiled
        .zip(row.compiled[0])
        .map(|(first, then)| (first - then).max(0.0));
    row
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |s| format!("{:.3}", s * 1e3))
}

fn x(v: Option<f64>) -> String {
    v.map_or("-".into(), |r| format!("{r:.1}"))
}

/// The markdown table of docs/PERFORMANCE.md.
fn table(rows: &[Row]) -> String {
    let mut t = String::from(
        "| kernel | interpreter 1T / 2T (ms) | compiled 1T / 2T (ms) | C 1T / 2T (ms) | interp/compiled 1T | compiled/C 1T | compile (ms) |\n|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            t,
            "| {} | {} / {} | {} / {} | {} / {}{} | {} | {} | {} |",
            r.name,
            ms(r.interpreter[0]),
            ms(r.interpreter[1]),
            ms(r.compiled[0]),
            ms(r.compiled[1]),
            ms(r.c[0]),
            ms(r.c[1]),
            if r.c_matches == Some(false) {
                " (differs)"
            } else {
                ""
            },
            x(ratio(r.interpreter[0], r.compiled[0])),
            x(ratio(r.compiled[0], r.c[0])),
            ms(r.compile),
        );
    }
    for (i, threads) in THREADS.iter().enumerate() {
        let _ = writeln!(
            t,
            "\nGeometric means at {threads} host thread(s): interpreter/compiled {}, compiled/C {}",
            x(geomean(
                rows.iter().map(|r| ratio(r.interpreter[i], r.compiled[i]))
            )),
            x(geomean(rows.iter().map(|r| ratio(r.compiled[i], r.c[i])))),
        );
    }
    t
}

fn json_num(v: Option<f64>) -> String {
    v.map_or("null".into(), |v| format!("{v:e}"))
}

fn json_list(v: &[Option<f64>]) -> String {
    let items: Vec<String> = v.iter().map(|&x| json_num(x)).collect();
    format!("[{}]", items.join(", "))
}

/// The results as JSON (seconds per launch, lists indexed like `threads`).
fn json(rows: &[Row]) -> String {
    let mut kernels = Vec::new();
    for r in rows {
        kernels.push(format!(
            "    {{\"kernel\": \"{}\", \"compiled\": {}, \"interpreter_s\": {}, \"compiled_s\": {}, \"c_s\": {}, \"compile_s\": {}, \"c_matches\": {}}}",
            r.name,
            r.ran_compiled,
            json_list(&r.interpreter),
            json_list(&r.compiled),
            json_list(&r.c),
            json_num(r.compile),
            r.c_matches.map_or("null".into(), |m| m.to_string()),
        ));
    }
    format!(
        "{{\n  \"bench\": \"ptx_engines\",\n  \"machine\": \"{}\",\n  \"threads\": {THREADS:?},\n  \"kernels\": [\n{}\n  ]\n}}\n",
        vgpu_bench_report::machine().replace('"', "'"),
        kernels.join(",\n")
    )
}

/// The figure: per thread count, the ratios interpreter/compiled and compiled/C per kernel.
fn figure(rows: &[Row], path: &Path) {
    let names: Vec<String> = rows.iter().map(|r| r.name.clone()).collect();
    let panel = |title: &str, f: &dyn Fn(&Row, usize) -> Option<f64>| {
        THREADS.iter().enumerate().fold(
            Panel::new(
                Kind::Bars,
                title,
                "kernel",
                "ratio of times per launch",
                names.clone(),
            ),
            |p, (i, threads)| {
                p.with(Series::new(
                    format!("{threads} host thread(s)"),
                    rows.iter().map(|r| f(r, i)).collect(),
                ))
            },
        )
    };
    let panels = [
        panel("interpreter / compiled", &|r, i| {
            ratio(r.interpreter[i], r.compiled[i])
        }),
        panel("compiled / C (gcc -O2)", &|r, i| {
            ratio(r.compiled[i], r.c[i])
        }),
    ];
    let title = format!(
        "PTX engines on the corpus kernels, {}",
        vgpu_bench_report::machine()
    );
    match vgpu_bench_report::write_svg(path, &title, &panels, 1) {
        Ok(()) => println!("SVG: {}", path.display()),
        Err(e) => eprintln!("no figure: {e}"),
    }
}

fn main() {
    if !vgpu_bench_report::criterion::measured() {
        return;
    }
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .unwrap_or_default();
    let Some(dir) = corpus_dir().filter(|d| d.join("ptx_classes").exists()) else {
        eprintln!("no CUDA corpus: run qemu-scripts/cuda-corpus.sh");
        return;
    };
    let c = CKernels::build();
    let mut modules: HashMap<&str, (String, Module)> = HashMap::new();
    let mut rows = Vec::new();
    for k in KERNELS
        .iter()
        .filter(|k| !k.faults && k.name().contains(&filter))
    {
        let (ptx, module) = modules.entry(k.program).or_insert_with(|| {
            let ptx = program_ptx(&dir, k.program).expect("ptx");
            let module = Module::parse(&ptx).expect("parse");
            (ptx, module)
        });
        let row = measure(module, ptx, k, c.as_ref());
        eprintln!(
            "{}: interpreter {} ms, compiled {} ms, C {} ms (1 thread)",
            row.name,
            ms(row.interpreter[0]),
            ms(row.compiled[0]),
            ms(row.c[0])
        );
        rows.push(row);
    }
    println!("{}", table(&rows));
    let target = vgpu_bench_report::criterion::criterion_dir()
        .parent()
        .map_or_else(|| PathBuf::from("target"), Path::to_path_buf);
    let json_path = target.join("ptx-engines.json");
    match std::fs::write(&json_path, json(&rows)) {
        Ok(()) => println!("JSON: {}", json_path.display()),
        Err(e) => eprintln!("writing {}: {e}", json_path.display()),
    }
    figure(&rows, &json_path.with_extension("svg"));
}
