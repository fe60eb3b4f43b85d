//! A guest's compute module image: the bytes are a module image (PTX text, a fat binary or an
//! ELF) as `cuModuleLoadData` receives it, unpacked from its headers (`fatbin::ptx_entries`),
//! decompressed and parsed under the VM's memory budget ([`BUDGET_BYTES`]), or, when they are
//! several NUL-separated PTX texts, the images `cuLinkAddData` receives, linked by
//! `module_link`; every kernel that parses is launched on two blocks of 33 threads over a
//! small context with zeroed parameters and a small instruction budget, compiled (on the
//! interpreter past [`COMPILED_TEXT_BYTES`] of text). Nothing may panic,
//! loop without bound, allocate past the budget or touch memory outside the context: every
//! failure is a `ComputeError`.
//!
//! The first byte picks the mode (its value modulo 3): 0, the rest is the image (or images)
//! itself; 1, the rest describes a fat binary (`vgpu_fuzz::compute::fatbin`: several
//! entries, LZ4 or Zstandard, bombs, declared sizes that lie), loaded, or linked when the
//! next byte is odd; 2, the rest describes a PTX module of deeply nested scopes and many
//! instructions (`vgpu_fuzz::compute::deep_ptx`), loaded (docs/FUZZING.md).
#![no_main]

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use libfuzzer_sys::fuzz_target;
use mdev_backend::budget::MemoryBudget;
use mdev_backend::compute::backend::{DEFAULT_STREAM, KernelLaunch};
use mdev_backend::compute::fatbin::ptx_of_all;
use mdev_backend::compute::ptx::{Engine, Module};
use mdev_backend::compute::{ComputeBackend, CpuBackend, CpuConfig};
use vgpu_fuzz::Input;
use vgpu_fuzz::compute::{deep_ptx, fatbin, kernel_name};

/// The VM's memory budget: a decompression or parse bomb must be refused at it, well below
/// the process's RSS limit (fuzz.sh), instead of being allocated.
const BUDGET_BYTES: u64 = 64 << 20;
/// Kernels launched per input.
const MAX_KERNELS: usize = 4;
/// Module text (PTX bytes, all images together) past which the kernels run on the
/// interpreter rather than compiled: Cranelift built with the fuzzer's instrumentation and
/// debug assertions is some 15 times slower than a release build, and a kernel near the
/// compiler's size limit (about 0.5 s to compile in a release build) would pass the input's
/// time limit (fuzz.sh) though nothing is wrong; up to this size the compiler is fuzzed.
const COMPILED_TEXT_BYTES: usize = 16 << 10;

/// How the module is made from the images.
enum Load {
    /// `cuModuleLoadData` of one image.
    One(Vec<u8>),
    /// `cuLinkAddData` of each, then `cuLinkComplete`.
    Link(Vec<Vec<u8>>),
}

/// The kernels of `texts` (an image's PTX texts) as a guest would find them (read with the
/// same budget, uncancelled): linked together, or the first text that parses alone.
fn kernel_names(texts: &[&str], link: bool, budget: &Arc<MemoryBudget>) -> Vec<String> {
    let never = AtomicBool::new(false);
    let module = if link {
        Module::load(texts, budget, &never).ok()
    } else {
        texts
            .iter()
            .find_map(|t| Module::load(&[t], budget, &never).ok())
    };
    module
        .map(|(m, _)| m.kernels().take(MAX_KERNELS).map(str::to_string).collect())
        .unwrap_or_default()
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let budget = MemoryBudget::new(BUDGET_BYTES);
    let (load, generated) = match input.u8() % 3 {
        0 => {
            let rest = input.rest();
            let texts: Vec<&[u8]> = rest.split(|&b| b == 0).filter(|p| !p.is_empty()).collect();
            let all_text = texts.iter().all(|t| std::str::from_utf8(t).is_ok());
            if all_text && (2..=8).contains(&texts.len()) {
                (
                    Load::Link(texts.iter().map(|t| t.to_vec()).collect()),
                    false,
                )
            } else {
                (Load::One(rest.to_vec()), false)
            }
        }
        1 => {
            let link = input.u8() % 2 == 1;
            let image = fatbin(&mut input);
            (
                if link {
                    Load::Link(vec![image])
                } else {
                    Load::One(image)
                },
                true,
            )
        }
        _ => (Load::One(deep_ptx(&mut input).into_bytes()), true),
    };
    let images: Vec<&[u8]> = match &load {
        Load::One(image) => vec![image],
        Load::Link(images) => images.iter().map(Vec::as_slice).collect(),
    };
    // The texts' size, and the kernels to launch (a generated module's are known), read
    // before the backend's load and given back to the budget before it.
    let (text_bytes, names) = {
        let never = AtomicBool::new(false);
        let texts = ptx_of_all(&images, &budget, &never).unwrap_or_default();
        let texts: Vec<&str> = texts.iter().map(|t| &**t).collect();
        let names: Vec<String> = if generated {
            (0..MAX_KERNELS).map(kernel_name).collect()
        } else {
            kernel_names(&texts, matches!(load, Load::Link(_)), &budget)
        };
        (texts.iter().map(|t| t.len()).sum::<usize>(), names)
    };
    let config = CpuConfig {
        engine: if text_bytes <= COMPILED_TEXT_BYTES {
            Engine::Compiled
        } else {
            Engine::Interpreter
        },
        budget: Arc::clone(&budget),
        memory_per_context: 1 << 20,
        instruction_budget: 20_000,
        threads: 1,
        ..CpuConfig::default()
    };
    let mut be = CpuBackend::new(config);
    let ctx = be.context_create().expect("a first context");
    let guard = be.mem_alloc(ctx, 4096).expect("a small allocation");
    be.copy_htod(ctx, guard, &[0xa5; 4096], DEFAULT_STREAM)
        .expect("in range");
    let loaded = match &load {
        Load::One(image) => be.module_load(ctx, image),
        Load::Link(_) => be.module_link(ctx, &images),
    };
    let Ok(module) = loaded else {
        be.context_destroy(ctx).expect("destroy");
        return;
    };
    for name in names {
        let Ok((function, params)) = be.function(ctx, module, &name) else {
            continue;
        };
        let size = params.iter().map(|p| p.offset + p.size).max().unwrap_or(0);
        let buf = vec![0u8; size as usize];
        let launch = KernelLaunch {
            function,
            grid: [2, 1, 1],
            block: [33, 1, 1],
            shared_bytes: 64,
            stream: DEFAULT_STREAM,
            params: &buf,
            cooperative: false,
        };
        if be.launch(ctx, &launch).is_err() {
            break;
        }
    }
    let _ = be.take_output(ctx);
    // A broken context refuses the read; a healthy one still holds the guard bytes unless a
    // kernel wrote them through a pointer it computed, which is its own memory.
    let mut back = [0u8; 16];
    let _ = be.copy_dtoh(ctx, &mut back, guard, DEFAULT_STREAM);
    be.context_destroy(ctx).expect("destroy");
    // Everything the context held was given back with it.
    assert_eq!(budget.used(), 0, "budget charges outlive the context");
});
