//! The cgroup and /proc parsers the daemon reads a QEMU's cgroup and threads with:
//! `/proc/PID/cgroup`, a thread's `stat` and `schedstat`, and vCPU thread names. Each must
//! refuse or parse without panicking; a parsed cgroup path is relative and plain.
#![no_main]

use std::path::{Component, Path};

use libfuzzer_sys::fuzz_target;
use vgpu_fuzz::Input;
use vgpu_schedd::cgroup;

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let which = input.u8();
    let rest = input.rest();
    match which % 4 {
        0 => {
            let text = String::from_utf8_lossy(rest);
            if let Ok(parsed) = cgroup::parse_proc_cgroup(Path::new("cgroup"), &text) {
                for path in [&parsed.v2, &parsed.v1_cpu, &parsed.v1_cpuacct]
                    .into_iter()
                    .flatten()
                {
                    assert!(
                        path.components().all(|c| matches!(c, Component::Normal(_))),
                        "{path:?} escapes the cgroup root"
                    );
                }
            }
        }
        1 => {
            if let Ok((comm, state)) = cgroup::parse_stat(rest) {
                assert!(state.is_ascii_alphabetic());
                assert!(comm.len() < rest.len());
            }
        }
        2 => {
            let _ = cgroup::parse_schedstat(&String::from_utf8_lossy(rest));
        }
        _ => {
            let _ = cgroup::is_vcpu_comm(&String::from_utf8_lossy(rest));
        }
    }
});
