//! What the guest's `vgpu-smi` samples, through the library's Rust API as the tool calls it
//! (`transport::connect`, `Driver`, `smi`), against a served CPU backend (the code each
//! connection of `vgpu-cuda-host` runs): the memory is the backend's budget, and the
//! utilisation between two samples is 0 while nothing runs and moves when a kernel ran
//! between them, deferred by the library and sent at the synchronisation.

use std::time::Duration;

use cuda::driver::{Driver, Image, LaunchParams};
use cuda::smi::{Report, Usage};
use mdev_backend::compute::CpuConfig;

mod support;

/// A kernel spinning `n` iterations in every thread.
const SPIN: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
    .visible .entry spin(.param .u32 n)\n{\n.reg .b32 %r<3>;\n.reg .pred %p;\n\
    ld.param.u32 %r1, [n];\nmov.u32 %r2, 0;\nLOOP:\nadd.u32 %r2, %r2, 1;\n\
    setp.lt.u32 %p, %r2, %r1;\n@%p bra LOOP;\nret;\n}\n";

#[test]
fn the_report_shows_the_budget_and_the_utilisation_moves_after_a_kernel() {
    let host = support::serve_cpu_backend("smi");
    let t = cuda::transport::connect().expect("the served socket");
    let mut d = Driver::new(t).expect("a device");
    let idle = Report::take(&mut d, Duration::from_millis(20)).expect("a report");
    assert_eq!(idle.total, CpuConfig::default().budget.limit());
    assert!(
        idle.free < idle.total,
        "its own context held a reserve while it asked"
    );
    assert_eq!(idle.utilisation, Some(0.0), "nothing ran");

    let ctx = d.context_create().unwrap();
    let module = d
        .module_load(ctx, Image::Single(SPIN.as_bytes().to_vec()))
        .unwrap();
    let spin = d.function(module, "spin").unwrap();
    let before = Usage::take(&mut d).unwrap();
    let n = 20_000u32.to_le_bytes().to_vec();
    d.launch(
        ctx,
        spin,
        [8, 1, 1],
        [64, 1, 1],
        0,
        0,
        LaunchParams::Each(vec![n]),
        false,
    )
    .unwrap();
    d.synchronize(ctx).unwrap();
    let after = Usage::take(&mut d).unwrap();
    let u = after.utilisation_since(&before).expect("time passed");
    assert!(u > 0.0 && u <= 1.0, "{u} from {before:?} to {after:?}");
    d.context_destroy(ctx).unwrap();
    host.close();
}
