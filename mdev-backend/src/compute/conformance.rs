//! One trait-level sequence every [`ComputeBackend`] must pass: run on the CPU backend here and
//! on `NvCuda` where the driver loads.

use super::ComputeError;
use super::backend::{
    ComputeBackend, ContextId, DEFAULT_STREAM, EventId, KernelLaunch, ModuleId, StreamId,
};

/// The kernels of the CPU tests and a global variable, at a PTX version every CUDA 11+
/// driver JITs.
fn ptx() -> String {
    super::cpu::validation_tests::PTX
        .replace(".version 8.5\n.target sm_75", ".version 7.0\n.target sm_70")
        + "\n.visible .global .align 4 .u32 tally[4];\n"
}

/// Runs the sequence; `runaway` also launches a kernel that never ends (only where a budget
/// stops it).
pub(crate) fn run(b: &mut dyn ComputeBackend, runaway: bool) {
    let attrs = b.attributes();
    assert!(
        attrs.warp_size == 32 && attrs.max_threads_per_block >= 1024,
        "{attrs:?}"
    );
    let c = b.context_create().unwrap();
    // Bad ids and ranges: errors, and the context goes on.
    let bad = |r: Result<(), ComputeError>| {
        assert!(
            matches!(
                r,
                Err(ComputeError::InvalidHandle(_)) | Err(ComputeError::InvalidValue(_))
            ),
            "{r:?}"
        )
    };
    // The context's memory budget is the device memory it reports.
    let r = b.mem_alloc(c, attrs.total_memory + 1);
    assert!(matches!(r, Err(ComputeError::OutOfMemory(_))), "{r:?}");
    bad(b.context_synchronize(ContextId(u32::MAX)));
    bad(b.module_unload(c, ModuleId(u32::MAX)));
    bad(b.stream_synchronize(c, StreamId(u32::MAX)));
    bad(b.event_query(c, EventId(u32::MAX)));
    let n = 1 << 16;
    let bytes = n as u64 * 4;
    let x = b.mem_alloc(c, bytes).unwrap();
    let y = b.mem_alloc(c, bytes).unwrap();
    let z = b.mem_alloc(c, bytes).unwrap();
    bad(b.copy_htod(c, x, &vec![0; bytes as usize + 1], DEFAULT_STREAM));
    // Straddling the end of one allocation (a neighbour may start right after it on a GPU).
    bad(b.memset_d8(c, x + bytes - 1, 0, 2, DEFAULT_STREAM));
    bad(b.mem_free(c, x + 4));
    // Copies and memsets on a stream, timed by events.
    let s = b.stream_create(c).unwrap();
    let (e0, e1) = (b.event_create(c).unwrap(), b.event_create(c).unwrap());
    let xs: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    b.event_record(c, e0, s).unwrap();
    b.copy_htod(c, x, &xs, s).unwrap();
    b.memset_d32(c, y, 2.5f32.to_bits(), n as u64, s).unwrap();
    b.memset_d8(c, z, 0xff, bytes, s).unwrap();
    // Vector add on the same stream, then read back.
    let m = b.module_load(c, ptx().as_bytes()).unwrap();
    let f = b.function(c, m, "vadd").unwrap();
    assert_eq!(f.1.len(), 4);
    // Its attributes: registers and a block size a launch may use; unknown functions refused.
    let fa = b.function_attributes(c, f.0).unwrap();
    assert!(fa.num_regs > 0 && fa.max_threads_per_block >= 256, "{fa:?}");
    assert!(matches!(
        b.function_attributes(c, super::backend::FunctionId(u32::MAX)),
        Err(ComputeError::InvalidHandle(_))
    ));
    let mut params = Vec::new();
    for p in [x, y, z] {
        params.extend_from_slice(&p.to_le_bytes());
    }
    params.extend_from_slice(&(n as u32).to_le_bytes());
    let mut launch = KernelLaunch {
        function: f.0,
        grid: [(n as u32).div_ceil(256), 1, 1],
        block: [256, 1, 1],
        shared_bytes: 0,
        stream: s,
        params: &params[..20],
        cooperative: false,
    };
    // A parameter buffer shorter than the kernel's and an empty grid are refused, not run.
    bad(b.launch(c, &launch));
    launch.params = &params;
    launch.grid = [0, 1, 1];
    bad(b.launch(c, &launch));
    launch.grid = [(n as u32).div_ceil(256), 1, 1];
    b.launch(c, &launch).unwrap();
    b.event_record(c, e1, s).unwrap();
    b.event_synchronize(c, e1).unwrap();
    b.event_query(c, e1).unwrap();
    b.stream_query(c, s).unwrap();
    assert!(b.event_elapsed_ms(c, e0, e1).unwrap() >= 0.0);
    let mut out = vec![0; bytes as usize];
    b.copy_dtoh(c, &mut out, z, s).unwrap();
    for (i, w) in out.chunks(4).enumerate() {
        assert_eq!(f32::from_le_bytes(w.try_into().unwrap()), i as f32 + 2.5);
    }
    b.copy_dtod(c, y, z, bytes, DEFAULT_STREAM).unwrap();
    b.context_synchronize(c).unwrap();
    let mut back = vec![0; bytes as usize];
    b.copy_dtoh(c, &mut back, y, DEFAULT_STREAM).unwrap();
    assert_eq!(back, out);
    // A module global is memory of the context: copies reach it, and only it.
    let (g, size) = b.module_global(c, m, "tally").unwrap();
    assert_eq!(size, 16);
    b.copy_htod(c, g, &[9; 16], DEFAULT_STREAM).unwrap();
    let mut tally = [0u8; 16];
    b.copy_dtoh(c, &mut tally, g, DEFAULT_STREAM).unwrap();
    assert_eq!(tally, [9; 16]);
    bad(b.copy_htod(c, g + 8, &[0; 16], DEFAULT_STREAM));
    b.event_destroy(c, e0).unwrap();
    b.stream_destroy(c, s).unwrap();
    b.mem_free(c, x).unwrap();
    b.module_unload(c, m).unwrap();
    // A kernel writing outside every allocation: IllegalAddress, then the context is broken
    // and only destroy works; another context is unaffected, unless faults are process-wide.
    let other = b.context_create().unwrap();
    let m = b.module_load(c, ptx().as_bytes());
    let m = m.unwrap();
    let poke = b.function(c, m, "poke").unwrap();
    let wild = 8u64.to_le_bytes();
    let launched = b.launch(
        c,
        &KernelLaunch {
            function: poke.0,
            grid: [1; 3],
            block: [1; 3],
            shared_bytes: 0,
            stream: DEFAULT_STREAM,
            params: &wild,
            cooperative: false,
        },
    );
    let r = launched.and_then(|()| b.context_synchronize(c));
    assert!(matches!(r, Err(ComputeError::IllegalAddress(_))), "{r:?}");
    assert!(matches!(
        b.mem_alloc(c, 16),
        Err(ComputeError::ContextBroken(_))
    ));
    if b.faults_are_process_wide() {
        // The real driver: every context of the process is broken, and so are new ones.
        assert!(matches!(
            b.mem_alloc(other, 16),
            Err(ComputeError::ContextBroken(_))
        ));
        assert!(matches!(
            b.context_create(),
            Err(ComputeError::ContextBroken(_))
        ));
        return;
    }
    let a = b.mem_alloc(other, 16).unwrap();
    b.memset_d8(other, a, 1, 16, DEFAULT_STREAM).unwrap();
    // Destroying a faulted context may report its fault again; either way it is gone.
    let r = b.context_destroy(c);
    assert!(r.as_ref().map_or_else(|e| e.is_sticky(), |_| true), "{r:?}");
    bad(b.context_synchronize(c));
    if runaway {
        let m = b.module_load(other, ptx().as_bytes()).unwrap();
        let spin = b.function(other, m, "spin").unwrap();
        let r = b.launch(
            other,
            &KernelLaunch {
                function: spin.0,
                grid: [1; 3],
                block: [32, 1, 1],
                shared_bytes: 0,
                stream: DEFAULT_STREAM,
                params: &[],
                cooperative: false,
            },
        );
        assert!(matches!(r, Err(ComputeError::LaunchTimeout(_))), "{r:?}");
    }
    b.context_destroy(other).unwrap();
}

#[test]
fn the_conformance_sequence_on_the_real_driver() {
    match super::NvCuda::with_memory_per_context(0, 256 << 20) {
        Ok(mut b) => {
            println!("running on {:?}", b.attributes());
            run(&mut b, false);
        }
        Err(e) => println!("skipped: NvCuda unavailable: {e}"),
    }
}

#[test]
fn the_conformance_sequence_on_the_cpu_backend() {
    let mut b = super::CpuBackend::new(super::CpuConfig {
        memory_per_context: 16 << 20,
        instruction_budget: 1 << 20,
        threads: 2,
        ..super::CpuConfig::default()
    });
    run(&mut b, true);
}
