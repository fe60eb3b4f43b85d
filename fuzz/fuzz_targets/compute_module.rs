//! A guest's compute module image: the bytes are a module image (PTX text, a fat binary or an
//! ELF) as `cuModuleLoadData` receives it, unpacked by `fatbin::extract_ptx` and parsed by the
//! PTX executor, or, when they are several NUL-separated PTX texts, the images
//! `cuLinkAddData` receives, linked by `module_link`; every kernel that parses is launched on two blocks of 33 threads over a small
//! context with zeroed parameters and a small instruction budget. Nothing may panic, loop
//! without bound or touch memory outside the context: every failure is a `ComputeError`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mdev_backend::compute::backend::{DEFAULT_STREAM, KernelLaunch};
use mdev_backend::compute::fatbin::extract_ptx;
use mdev_backend::compute::ptx::Module;
use mdev_backend::compute::{ComputeBackend, CpuBackend, CpuConfig};

fuzz_target!(|data: &[u8]| {
    let config = CpuConfig {
        memory_per_context: 1 << 20,
        instruction_budget: 20_000,
        threads: 1,
        ..CpuConfig::default()
    };
    let mut be = CpuBackend::new(config);
    let ctx = be.context_create().expect("a first context");
    let guard = be.mem_alloc(ctx, 4096).expect("a small allocation");
    be.copy_htod(ctx, guard, &[0xa5; 4096], DEFAULT_STREAM).expect("in range");
    let texts: Vec<&str> = data
        .split(|&b| b == 0)
        .filter(|p| !p.is_empty())
        .map(std::str::from_utf8)
        .collect::<Result<_, _>>()
        .unwrap_or_default();
    let linking = (2..=8).contains(&texts.len());
    let loaded = if linking {
        let images: Vec<&[u8]> = texts.iter().map(|t| t.as_bytes()).collect();
        be.module_link(ctx, &images)
    } else {
        be.module_load(ctx, data)
    };
    let Ok(module) = loaded else {
        return;
    };
    // The kernels, named as a guest would find them.
    let names: Vec<String> = if linking {
        Module::link(&texts).ok()
    } else {
        extract_ptx(data)
            .ok()
            .and_then(|images| images.into_iter().find_map(|p| Module::parse(&p.text).ok()))
    }
    .map(|m| m.kernels().take(4).map(str::to_string).collect())
    .unwrap_or_default();
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
});
