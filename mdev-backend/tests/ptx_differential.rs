//! The PTX engines against each other over the nvcc corpus: every kernel a corpus
//! program launches (`compute::corpus_kernels::KERNELS`, with its program's own data) runs on
//! the interpreter and as compiled code, and both must leave the same bytes in every buffer,
//! print the same output and fail with the same error. Skipped (saying so) without the corpus
//! (`qemu-scripts/cuda-corpus.sh`); a failure under `VGPU_REQUIRE_CUDA_CORPUS`.

use std::collections::HashMap;
use std::path::Path;

use mdev_backend::compute::corpus::corpus_for_tests;
use mdev_backend::compute::corpus_kernels::{self, CorpusKernel, KERNELS, Outcome};
use mdev_backend::compute::ptx::{Engine, Module};

/// The corpus kernels the compiler does not take, so `Engine::Compiled` runs them on the
/// interpreter: `hello` calls printf. Every other corpus kernel must run as compiled code.
const INTERPRETED: [(&str, &str); 1] = [("hello", "hello")];

fn modules(dir: &Path) -> HashMap<&'static str, Module> {
    let mut modules = HashMap::new();
    for k in &KERNELS {
        modules.entry(k.program).or_insert_with(|| {
            let ptx = corpus_kernels::program_ptx(dir, k.program).expect("ptx");
            Module::parse(&ptx).expect("parse")
        });
    }
    modules
}

fn run(module: &Module, k: &CorpusKernel, engine: Engine, threads: usize) -> Outcome {
    corpus_kernels::run(module, k, engine, threads)
        .unwrap_or_else(|e| panic!("{}: setup: {e}", k.name()))
}

/// The first differing byte of two buffers, for the failure message.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

fn assert_same(k: &CorpusKernel, reference: &Outcome, compiled: &Outcome, what: &str) {
    let name = k.name();
    match (&reference.result, &compiled.result) {
        (Ok(r), Ok(c)) => {
            assert!(!k.faults, "{name}: its launch must fault");
            assert_eq!(r.output, c.output, "{name} ({what}): printf output");
            assert_eq!(r.blocks, c.blocks, "{name} ({what}): blocks");
        }
        (Err(r), Err(c)) => {
            assert!(k.faults, "{name}: {r}");
            assert_eq!(r.to_string(), c.to_string(), "{name} ({what}): error");
        }
        (r, c) => panic!("{name} ({what}): the interpreter gave {r:?}, compiled code {c:?}"),
    }
    assert_eq!(reference.buffers.len(), compiled.buffers.len());
    for (i, (r, c)) in reference.buffers.iter().zip(&compiled.buffers).enumerate() {
        if let Some(at) = first_difference(r, c) {
            panic!(
                "{name} ({what}): buffer {i} differs first at byte {at}: {:#04x} interpreted, {:#04x} compiled",
                r[at], c[at]
            );
        }
    }
}

#[test]
fn corpus_kernels_agree_on_both_engines() {
    let Some(dir) = corpus_for_tests("ptx_classes") else {
        return;
    };
    let modules = modules(&dir);
    let mut compiled_kernels = Vec::new();
    for k in &KERNELS {
        let module = &modules[k.program];
        let reference = run(module, k, Engine::Interpreter, 1);
        if let Ok(stats) = &reference.result {
            assert!(!stats.compiled, "{}: the interpreter ran it", k.name());
        }
        for threads in [1, 2] {
            let compiled = run(module, k, Engine::Compiled, threads);
            assert_same(k, &reference, &compiled, &format!("{threads} threads"));
            if let Ok(stats) = &compiled.result {
                let interpreted = INTERPRETED.contains(&(k.program, k.kernel));
                assert_eq!(
                    stats.compiled,
                    !interpreted,
                    "{}: compiled code ran it: {}",
                    k.name(),
                    stats.compiled
                );
                if threads == 1 && stats.compiled {
                    compiled_kernels.push(k.name());
                }
            }
        }
    }
    eprintln!("compiled: {}", compiled_kernels.join(", "));
}

#[test]
fn every_corpus_kernel_sets_up() {
    let Some(dir) = corpus_for_tests("ptx_classes") else {
        return;
    };
    let modules = modules(&dir);
    for k in &KERNELS {
        let s = corpus_kernels::setup(&modules[k.program], k).expect("setup");
        assert!(s.ptx_name.starts_with("_Z"), "{}", s.ptx_name);
        assert_eq!(s.buffers.len(), (k.buffers)().len());
    }
}

#[test]
fn a_kernel_the_program_does_not_have_is_refused() {
    let Some(dir) = corpus_for_tests("vector_add") else {
        return;
    };
    let module = Module::parse(&corpus_kernels::program_ptx(&dir, "vector_add").unwrap()).unwrap();
    let missing = CorpusKernel {
        kernel: "matmul",
        ..KERNELS[0]
    };
    let e = corpus_kernels::setup(&module, &missing).unwrap_err();
    assert!(e.to_string().contains("0 kernels named matmul"), "{e}");
}

#[test]
fn bad_arguments_are_refused() {
    let Some(dir) = corpus_for_tests("vector_add") else {
        return;
    };
    let module = Module::parse(&corpus_kernels::program_ptx(&dir, "vector_add").unwrap()).unwrap();
    use corpus_kernels::Arg;
    let short = CorpusKernel {
        args: &[Arg::Buffer(0)],
        ..KERNELS[0]
    };
    let e = corpus_kernels::setup(&module, &short).unwrap_err();
    assert!(
        e.to_string().contains("1 arguments for 4 parameters"),
        "{e}"
    );
    let unknown = CorpusKernel {
        args: &[Arg::Buffer(0), Arg::Buffer(1), Arg::Buffer(7), Arg::Int(1)],
        ..KERNELS[0]
    };
    let e = corpus_kernels::setup(&module, &unknown).unwrap_err();
    assert!(e.to_string().contains("buffer 7"), "{e}");
    let huge = CorpusKernel {
        buffers: || (0..2).map(|_| vec![0; 100 << 20]).collect(),
        ..KERNELS[0]
    };
    let e = corpus_kernels::setup(&module, &huge).unwrap_err();
    assert!(e.to_string().contains("more than"), "{e}");
    let e = corpus_kernels::program_ptx(&dir, "no-such-program").unwrap_err();
    assert!(e.to_string().contains("no-such-program"), "{e}");
}

/// The corpus kernels left out of `KERNELS`: spin waits for the host to write mapped memory
/// while it runs; heap's need the heap size their program sets on its context first.
const LEFT_OUT: [(&str, &str); 3] = [("spin", "spin"), ("heap", "fill"), ("heap", "objects")];

#[test]
fn every_kernel_of_the_corpus_sources_is_listed_or_left_out() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/cuda");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("tests/cuda") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "cu") {
            continue;
        }
        let program = path.file_stem().unwrap().to_str().unwrap().to_string();
        let text = std::fs::read_to_string(&path).expect("source");
        for rest in text.split("__global__ void ").skip(1) {
            let name = rest.split('(').next().unwrap().trim().to_string();
            found.push((program.clone(), name));
        }
    }
    assert!(found.len() > KERNELS.len(), "{found:?}");
    for (program, kernel) in &found {
        let listed = KERNELS
            .iter()
            .any(|k| k.program == program && k.kernel == kernel);
        let left_out = LEFT_OUT.contains(&(program.as_str(), kernel.as_str()));
        assert!(
            listed != left_out,
            "{program}/{kernel}: listed {listed}, left out {left_out}"
        );
    }
    for k in &KERNELS {
        assert!(
            found.iter().any(|(p, n)| p == k.program && n == k.kernel),
            "{}: not in tests/cuda",
            k.name()
        );
    }
}

fn words<T>(b: &[u8], from: fn([u8; 4]) -> T) -> Vec<T> {
    b.chunks_exact(4)
        .map(|c| from(c.try_into().unwrap()))
        .collect()
}

/// The setups give the kernels their programs' data: results checked as the programs check
/// them, on the host.
#[test]
fn the_setups_compute_what_their_programs_check() {
    let Some(dir) = corpus_for_tests("matmul") else {
        return;
    };
    let modules = modules(&dir);
    let outcome_of = |program: &str, kernel: &str| {
        let k = KERNELS
            .iter()
            .find(|k| k.program == program && k.kernel == kernel)
            .unwrap();
        let o = run(&modules[k.program], k, Engine::Compiled, 2);
        o.result.as_ref().expect("launch");
        o.buffers
    };
    let outcome = |program: &str| {
        let k = KERNELS.iter().find(|k| k.program == program).unwrap();
        outcome_of(program, k.kernel)
    };
    let b = outcome("vector_add");
    let (x, y, sum) = (
        words(&b[0], f32::from_le_bytes),
        words(&b[1], f32::from_le_bytes),
        words(&b[2], f32::from_le_bytes),
    );
    assert_eq!(sum.len(), 100_000);
    assert!((0..sum.len()).all(|i| sum[i] == x[i] + y[i]));
    let b = outcome("reduce");
    let want = words(&b[0], u32::from_le_bytes)
        .into_iter()
        .fold(0u32, u32::wrapping_add);
    assert_eq!(words(&b[1], u32::from_le_bytes), [want]);
    let b = outcome("matmul");
    let (a, m, c) = (
        words(&b[0], f32::from_le_bytes),
        words(&b[1], f32::from_le_bytes),
        words(&b[2], f32::from_le_bytes),
    );
    let n = 128;
    for (r, col) in [(0, 0), (5, 77), (127, 127)] {
        let s = (0..n).fold(0f32, |s, k| a[r * n + k].mul_add(m[k * n + col], s));
        assert_eq!(c[r * n + col], s, "C[{r}][{col}]");
    }
    // Point sampling of the pitched integers, with a border of zeros.
    let b = outcome_of("texture", "fetch_int");
    let (ints, at, got) = (
        words(&b[0], i32::from_le_bytes),
        words(&b[1], f32::from_le_bytes),
        words(&b[2], i32::from_le_bytes),
    );
    for k in 0..64 {
        let (x, y) = (at[2 * k].floor() as i32, at[2 * k + 1].floor() as i32);
        let inside = (0..24).contains(&x) && (0..10).contains(&y);
        let want = if inside {
            ints[(y * 24 + x) as usize]
        } else {
            0
        };
        assert_eq!(got[k], want, "fetch_int {k}");
    }
    let b = outcome_of("surface", "paint");
    let painted = words(&b[0], f32::from_le_bytes);
    for (i, v) in painted.iter().enumerate() {
        assert_eq!(
            *v,
            (i % 40) as f32 * 0.5 + (i / 40) as f32 * 100.0,
            "paint {i}"
        );
    }
    let b = outcome("histogram");
    let mut bins = [0u32; 256];
    b[0].iter().for_each(|&v| bins[usize::from(v)] += 1);
    assert_eq!(words(&b[1], u32::from_le_bytes), bins);
}
