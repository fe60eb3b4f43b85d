//! CpuBackend validation tests: every call's checks, round trips, stream/event semantics, sticky
//! errors and limits, through the trait.

use super::*;
use crate::compute::ComputeResult;
use crate::compute::memory::{ALLOCATION_ALIGN, ALLOCATION_RECORD_BYTES};

/// `c[i] = a[i] + b[i]` for `i < n`, a kernel that spins forever, and one that writes at the
/// address it is given.
pub(crate) const PTX: &str = r#"
.version 8.5
.target sm_75
.address_size 64

.visible .entry vadd(.param .u64 pa, .param .u64 pb, .param .u64 pc, .param .u32 pn)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<11>;
    ld.param.u64 %rd1, [pa];
    ld.param.u64 %rd2, [pb];
    ld.param.u64 %rd3, [pc];
    ld.param.u32 %r2, [pn];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.s32 %r1, %r3, %r4, %r5;
    setp.ge.s32 %p1, %r1, %r2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd4, %rd1;
    cvta.to.global.u64 %rd5, %rd2;
    cvta.to.global.u64 %rd6, %rd3;
    mul.wide.s32 %rd7, %r1, 4;
    add.s64 %rd8, %rd4, %rd7;
    add.s64 %rd9, %rd5, %rd7;
    add.s64 %rd10, %rd6, %rd7;
    ld.global.f32 %f1, [%rd8];
    ld.global.f32 %f2, [%rd9];
    add.f32 %f3, %f1, %f2;
    st.global.f32 [%rd10], %f3;
DONE:
    ret;
}

.visible .entry spin()
{
LOOP:
    bra LOOP;
}

.visible .entry poke(.param .u64 addr)
{
    .reg .b32 %r<2>;
    .reg .b64 %rd<3>;
    ld.param.u64 %rd1, [addr];
    mov.u32 %r1, 7;
    st.global.u32 [%rd1], %r1;
    ret;
}

.visible .entry empty()
{
    ret;
}
"#;

fn backend() -> CpuBackend {
    CpuBackend::new(CpuConfig {
        budget: MemoryBudget::new(1 << 30),
        memory_per_context: 16 << 20,
        instruction_budget: 1 << 20,
        ..CpuConfig::default()
    })
}

fn invalid_value<T: std::fmt::Debug>(r: ComputeResult<T>) {
    assert!(
        matches!(r, Err(ComputeError::InvalidValue(_))),
        "expected InvalidValue, got {r:?}"
    );
}

fn invalid_handle<T: std::fmt::Debug>(r: ComputeResult<T>) {
    assert!(
        matches!(r, Err(ComputeError::InvalidHandle(_))),
        "expected InvalidHandle, got {r:?}"
    );
}

#[test]
fn unknown_ids_are_invalid_handles_and_harm_nothing() {
    let mut b = backend();
    let c = b.context_create().unwrap();
    let bad = ContextId(c.0 + 1000);
    invalid_handle(b.mem_alloc(bad, 16));
    invalid_handle(b.context_synchronize(bad));
    invalid_handle(b.context_destroy(bad));
    invalid_handle(b.module_unload(c, ModuleId(77)));
    invalid_handle(b.function(c, ModuleId(77), "vadd"));
    invalid_handle(b.stream_destroy(c, StreamId(99)));
    invalid_handle(b.stream_destroy(c, DEFAULT_STREAM));
    invalid_handle(b.stream_synchronize(c, StreamId(99)));
    invalid_handle(b.event_record(c, EventId(5), DEFAULT_STREAM));
    invalid_handle(b.event_query(c, EventId(5)));
    invalid_handle(b.memset_d8(c, 0, 0, 1, StreamId(99)));
    let args = KernelLaunch {
        function: FunctionId(3),
        grid: [1; 3],
        block: [1; 3],
        shared_bytes: 0,
        stream: DEFAULT_STREAM,
        params: &[],
        cooperative: false,
    };
    invalid_handle(b.launch(c, &args));
    // Objects of one context are not reachable through another.
    let c2 = b.context_create().unwrap();
    let s = b.stream_create(c).unwrap();
    let e = b.event_create(c).unwrap();
    let m = b.module_load(c, PTX.as_bytes()).unwrap();
    invalid_handle(b.stream_synchronize(c2, s));
    invalid_handle(b.event_query(c2, e));
    invalid_handle(b.function(c2, m, "vadd"));
    // The context is still usable.
    let a = b.mem_alloc(c, 64).unwrap();
    b.memset_d8(c, a, 1, 64, s).unwrap();
    b.context_synchronize(c).unwrap();
}

#[test]
fn sizes_and_ranges_are_checked_and_the_context_survives() {
    let mut b = backend();
    let c = b.context_create().unwrap();
    invalid_value(b.mem_alloc(c, 0));
    assert!(matches!(
        b.mem_alloc(c, 1 << 40),
        Err(ComputeError::OutOfMemory(_))
    ));
    let a = b.mem_alloc(c, 100).unwrap();
    let s = DEFAULT_STREAM;
    invalid_value(b.copy_htod(c, a, &[0; 101], s));
    invalid_value(b.copy_htod(c, a + 50, &[0; 51], s));
    invalid_value(b.copy_htod(c, a - 1, &[0; 1], s));
    invalid_value(b.copy_htod(c, 0x1000, &[0; 1], s));
    invalid_value(b.copy_dtoh(c, &mut [0; 101], a, s));
    invalid_value(b.copy_dtod(c, a, a + 1, 100, s));
    invalid_value(b.copy_dtod(c, a, u64::MAX - 3, 8, s));
    invalid_value(b.memset_d8(c, a, 0, 101, s));
    invalid_value(b.memset_d32(c, a, 0, 26, s));
    invalid_value(b.memset_d32(c, a + 2, 0, 1, s));
    invalid_value(b.memset_d32(c, a, 0, u64::MAX, s));
    invalid_value(b.mem_free(c, a + 4));
    // Nothing above broke the context.
    b.copy_htod(c, a, &[9; 100], s).unwrap();
    let mut out = [0; 100];
    b.copy_dtoh(c, &mut out, a, s).unwrap();
    assert_eq!(out, [9; 100]);
    b.mem_free(c, a).unwrap();
    invalid_value(b.mem_free(c, a));
}

#[test]
fn memsets_and_copies_round_trip() {
    let mut b = backend();
    let c = b.context_create().unwrap();
    let s = b.stream_create(c).unwrap();
    let x = b.mem_alloc(c, 200_000).unwrap();
    let y = b.mem_alloc(c, 200_000).unwrap();
    let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 % 251) as u8).collect();
    b.copy_htod(c, x, &data, s).unwrap();
    b.copy_dtod(c, y, x, 200_000, s).unwrap();
    let mut out = vec![0; 200_000];
    b.copy_dtoh(c, &mut out, y, s).unwrap();
    assert_eq!(out, data);
    // Overlapping device copy moves like memmove.
    b.copy_dtod(c, x + 1, x, 199_999, s).unwrap();
    b.copy_dtoh(c, &mut out, x, s).unwrap();
    assert_eq!(out[1..], data[..199_999]);
    b.memset_d8(c, x + 10, 0xab, 70_000, s).unwrap();
    b.memset_d32(c, y + 4, 0x0102_0304, 20_000, s).unwrap();
    b.copy_dtoh(c, &mut out, x, s).unwrap();
    assert!(out[10..70_010].iter().all(|&v| v == 0xab));
    assert_eq!(out[70_010], data[70_009]);
    b.copy_dtoh(c, &mut out, y, s).unwrap();
    assert_eq!(out[..4], data[..4]);
    for w in out[4..80_004].chunks(4) {
        assert_eq!(w, [4, 3, 2, 1]);
    }
    assert_eq!(out[80_004], data[80_004]);
}

#[test]
fn streams_and_events_order_and_time_work() {
    let mut b = backend();
    let c = b.context_create().unwrap();
    let s = b.stream_create(c).unwrap();
    let (e0, e1, never) = (
        b.event_create(c).unwrap(),
        b.event_create(c).unwrap(),
        b.event_create(c).unwrap(),
    );
    b.event_query(c, never).unwrap();
    b.event_synchronize(c, never).unwrap();
    invalid_handle(b.event_elapsed_ms(c, e0, never));
    let a = b.mem_alloc(c, 1 << 20).unwrap();
    b.event_record(c, e0, s).unwrap();
    b.memset_d8(c, a, 3, 1 << 20, s).unwrap();
    b.event_record(c, e1, s).unwrap();
    b.stream_query(c, s).unwrap();
    b.event_synchronize(c, e1).unwrap();
    b.event_query(c, e1).unwrap();
    let ms = b.event_elapsed_ms(c, e0, e1).unwrap();
    assert!(ms >= 0.0, "{ms}");
    assert!(b.event_elapsed_ms(c, e1, e0).unwrap() <= 0.0);
    // The memset between the records is visible after synchronising the stream.
    b.stream_synchronize(c, s).unwrap();
    let mut out = [0; 4];
    b.copy_dtoh(c, &mut out, a + 1000, DEFAULT_STREAM).unwrap();
    assert_eq!(out, [3; 4]);
    b.event_destroy(c, e0).unwrap();
    invalid_handle(b.event_destroy(c, e0));
    b.stream_destroy(c, s).unwrap();
    invalid_handle(b.stream_query(c, s));
}

#[test]
fn limits_bound_every_table() {
    let mut b = backend();
    let cs: Vec<_> = (0..MAX_CONTEXTS)
        .map(|_| b.context_create().unwrap())
        .collect();
    assert!(matches!(
        b.context_create(),
        Err(ComputeError::OutOfMemory(_))
    ));
    b.context_destroy(cs[1]).unwrap();
    let c = b.context_create().unwrap();
    for _ in 0..MAX_STREAMS_PER_CONTEXT {
        b.stream_create(c).unwrap();
    }
    assert!(matches!(
        b.stream_create(c),
        Err(ComputeError::OutOfMemory(_))
    ));
    for _ in 0..MAX_EVENTS_PER_CONTEXT {
        b.event_create(c).unwrap();
    }
    assert!(matches!(
        b.event_create(c),
        Err(ComputeError::OutOfMemory(_))
    ));
    let tiny = ".version 8.5\n.target sm_75\n.address_size 64\n.visible .entry k()\n{\nret;\n}\n";
    let mut ms = Vec::new();
    for _ in 0..MAX_MODULES_PER_CONTEXT {
        ms.push(b.module_load(c, tiny.as_bytes()).unwrap());
    }
    assert!(matches!(
        b.module_load(c, tiny.as_bytes()),
        Err(ComputeError::OutOfMemory(_))
    ));
    b.module_unload(c, ms[0]).unwrap();
    b.module_load(c, tiny.as_bytes()).unwrap();
    invalid_handle(b.module_unload(c, ms[0]));
}

#[test]
fn modules_and_launches_run_vector_add() {
    let mut b = backend();
    let c = b.context_create().unwrap();
    assert!(matches!(
        b.module_load(c, b"\x7fELF not ptx"),
        Err(ComputeError::InvalidImage(_))
    ));
    assert!(matches!(
        b.module_load(c, b".version 8.5\n.target sm_75\nbogus;"),
        Err(ComputeError::InvalidPtx(_))
    ));
    let m = b.module_load(c, PTX.as_bytes()).unwrap();
    assert!(matches!(
        b.function(c, m, "nope"),
        Err(ComputeError::NotFound(_))
    ));
    let f = b.function(c, m, "vadd").unwrap();
    assert_eq!(f.1.len(), 4);
    assert_eq!((f.1[3].offset, f.1[3].size), (24, 4));
    let n = 1000u32;
    let bytes = u64::from(n) * 4;
    let (x, y, z) = (
        b.mem_alloc(c, bytes).unwrap(),
        b.mem_alloc(c, bytes).unwrap(),
        b.mem_alloc(c, bytes).unwrap(),
    );
    let xs: Vec<u8> = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
    let ys: Vec<u8> = (0..n)
        .flat_map(|i| (2.0 * i as f32).to_le_bytes())
        .collect();
    let s = b.stream_create(c).unwrap();
    b.copy_htod(c, x, &xs, s).unwrap();
    b.copy_htod(c, y, &ys, s).unwrap();
    let mut params = Vec::new();
    for p in [x, y, z] {
        params.extend_from_slice(&p.to_le_bytes());
    }
    params.extend_from_slice(&n.to_le_bytes());
    let mut args = KernelLaunch {
        function: f.0,
        grid: [n.div_ceil(128), 1, 1],
        block: [128, 1, 1],
        shared_bytes: 0,
        stream: s,
        params: &params[..20],
        cooperative: false,
    };
    invalid_value(b.launch(c, &args));
    args.params = &params;
    args.block = [128, 0, 1];
    invalid_value(b.launch(c, &args));
    args.block = [1024, 2, 1];
    let r = b.launch(c, &args);
    assert!(
        matches!(
            r,
            Err(ComputeError::LaunchOutOfResources(_) | ComputeError::InvalidValue(_))
        ),
        "{r:?}"
    );
    args.block = [128, 1, 1];
    args.shared_bytes = 1 << 20;
    let r = b.launch(c, &args);
    assert!(
        matches!(
            r,
            Err(ComputeError::LaunchOutOfResources(_) | ComputeError::InvalidValue(_))
        ),
        "{r:?}"
    );
    args.shared_bytes = 0;
    b.launch(c, &args).unwrap();
    let mut out = vec![0; bytes as usize];
    b.copy_dtoh(c, &mut out, z, s).unwrap();
    for (i, w) in out.chunks(4).enumerate() {
        assert_eq!(f32::from_le_bytes(w.try_into().unwrap()), 3.0 * i as f32);
    }
    b.module_unload(c, m).unwrap();
    invalid_handle(b.launch(c, &args));
}

fn launch_alone(
    b: &mut CpuBackend,
    c: ContextId,
    m: ModuleId,
    name: &str,
    params: &[u8],
) -> ComputeResult<()> {
    let f = b.function(c, m, name)?;
    b.launch(
        c,
        &KernelLaunch {
            function: f.0,
            grid: [1; 3],
            block: [32, 1, 1],
            shared_bytes: 0,
            stream: DEFAULT_STREAM,
            params,
            cooperative: false,
        },
    )
}

#[test]
fn faults_and_runaway_kernels_break_only_their_context() {
    let mut b = backend();
    let c = b.context_create().unwrap();
    let other = b.context_create().unwrap();
    let m = b.module_load(c, PTX.as_bytes()).unwrap();
    let a = b.mem_alloc(c, 64).unwrap();
    // Inside its allocation the kernel writes.
    launch_alone(&mut b, c, m, "poke", &a.to_le_bytes()).unwrap();
    let mut out = [0; 4];
    b.copy_dtoh(c, &mut out, a, DEFAULT_STREAM).unwrap();
    assert_eq!(u32::from_le_bytes(out), 7);
    // Past it: an illegal address, then the context is broken for everything but destroy.
    let r = launch_alone(&mut b, c, m, "poke", &(a + 64).to_le_bytes());
    assert!(matches!(r, Err(ComputeError::IllegalAddress(_))), "{r:?}");
    let broken = b.mem_alloc(c, 16);
    assert!(
        matches!(broken, Err(ComputeError::ContextBroken(_))),
        "{broken:?}"
    );
    assert_eq!(broken.unwrap_err().cuda_status(), 719);
    assert!(matches!(
        b.context_synchronize(c),
        Err(ComputeError::ContextBroken(_))
    ));
    // The other context is unaffected; the broken one can be destroyed.
    b.mem_alloc(other, 16).unwrap();
    b.context_destroy(c).unwrap();
    invalid_handle(b.context_synchronize(c));
    // A runaway kernel hits the instruction budget.
    let m2 = b.module_load(other, PTX.as_bytes()).unwrap();
    let r = launch_alone(&mut b, other, m2, "spin", &[]);
    assert!(matches!(r, Err(ComputeError::LaunchTimeout(_))), "{r:?}");
    assert!(matches!(
        b.mem_alloc(other, 16),
        Err(ComputeError::ContextBroken(_))
    ));
}

/// Two allocations of 2 MiB (more than one copy chunk), filled with 1s and 2s.
fn two_filled(b: &mut CpuBackend, c: ContextId) -> (u64, u64) {
    let x = b.mem_alloc(c, 2 << 20).unwrap();
    let y = b.mem_alloc(c, 2 << 20).unwrap();
    b.memset_d8(c, x, 1, 2 << 20, DEFAULT_STREAM).unwrap();
    b.memset_d8(c, y, 2, 2 << 20, DEFAULT_STREAM).unwrap();
    (x, y)
}

/// Every byte of the allocation at `a` (2 MiB) is still `value`.
fn unchanged(b: &mut CpuBackend, c: ContextId, a: u64, value: u8) {
    let mut out = vec![0; 2 << 20];
    b.copy_dtoh(c, &mut out, a, DEFAULT_STREAM).unwrap();
    assert!(
        out.iter().all(|&v| v == value),
        "the allocation was written"
    );
}

#[test]
fn copy_and_memset_lengths_that_wrap_around_2_64_are_refused_before_any_write() {
    let mut b = backend();
    let c = b.context_create().unwrap();
    let (x, y) = two_filled(&mut b, c);
    let s = DEFAULT_STREAM;
    // `offset + bytes` wraps to 0: 16 bytes into an allocation, 2^64 - 16 bytes long.
    let wrap = 0u64.wrapping_sub(16);
    invalid_value(b.copy_dtod(c, y + 16, x + 16, wrap, s));
    invalid_value(b.copy_dtod(c, y + 16, x, wrap, s));
    invalid_value(b.copy_dtod(c, y, x + 16, wrap, s));
    invalid_value(b.copy_dtod(c, y + 16, x + 16, u64::MAX, s));
    invalid_value(b.memset_d32(c, y + 16, 0xdead_beef, wrap / 4, s));
    invalid_value(b.memset_d32(c, y + 16, 0xdead_beef, wrap / 4 + 1, s));
    invalid_value(b.memset_d8(c, y + 16, 0xee, wrap, s));
    // Addresses near the top of the address space.
    for a in [u64::MAX, u64::MAX - 3, u64::MAX - 15] {
        invalid_value(b.copy_dtod(c, a, x, 16, s));
        invalid_value(b.copy_dtod(c, y, a, 16, s));
        invalid_value(b.memset_d32(c, a & !3, 1, 4, s));
        invalid_value(b.memset_d8(c, a, 1, 16, s));
        invalid_value(b.copy_htod(c, a, &[3; 16], s));
        invalid_value(b.copy_dtoh(c, &mut [0; 16], a, s));
    }
    unchanged(&mut b, c, x, 1);
    unchanged(&mut b, c, y, 2);
    // The context is not broken by any of it.
    b.copy_dtod(c, y, x, 2 << 20, s).unwrap();
    unchanged(&mut b, c, y, 1);
}

/// A kernel that stores 7 through a generic address (no state space), as nvcc emits for a
/// pointer it cannot prove global.
const GENERIC_POKE: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
    .visible .entry gpoke(.param .u64 p)\n{\n.reg .b32 %r<2>;\n.reg .b64 %rd<2>;\n\
    ld.param.u64 %rd1, [p];\nmov.u32 %r1, 7;\nst.u32 [%rd1], %r1;\nret;\n}\n";

/// Places a context at `base`, allocates in it and stores through a generic pointer there:
/// the value must land in the allocation.
fn generic_store_in_window(b: &mut CpuBackend, base: u64, size: u64) -> ComputeResult<()> {
    let c = b.context_create_at(base, size)?;
    let a = b.mem_alloc(c, 64)?;
    let m = b.module_load(c, GENERIC_POKE.as_bytes())?;
    launch_alone(b, c, m, "gpoke", &a.to_le_bytes())?;
    let mut out = [0; 4];
    b.copy_dtoh(c, &mut out, a, DEFAULT_STREAM)?;
    assert_eq!(u32::from_le_bytes(out), 7, "context at {base:#x}");
    b.context_destroy(c)
}

#[test]
fn placed_windows_never_overlap_the_executors_generic_shared_local_and_function_windows() {
    let mut b = backend();
    let size = 4 * WINDOW_ALIGN;
    // Where the executor decodes generic addresses as shared memory, local memory and
    // functions (ptx::exec's SHARED_WINDOW, LOCAL_WINDOW, ir's FUNC_WINDOW): a placed window
    // there is refused (an allocation there would read and write shared or local memory).
    for base in [
        0x1000_0000_0000u64,
        0x2000_0000_0000,
        0x3000_0000_0000,
        0x1000_0000_0000 - WINDOW_ALIGN,
        0x3fff_ffff_0000,
    ] {
        let r = generic_store_in_window(&mut b, base, size);
        assert!(
            matches!(r, Err(ComputeError::InvalidValue(_))),
            "window {base:#x}: {r:?}"
        );
    }
    // Just outside, generic accesses reach the allocation.
    generic_store_in_window(&mut b, 0x1000_0000_0000 - size, size).unwrap();
    generic_store_in_window(&mut b, 0x4000_0000_0000, size).unwrap();
    generic_store_in_window(&mut b, 0x7fff_0000_0000, size).unwrap();
}

/// A backend whose contexts share a budget of `limit` bytes, each allowed 1 GiB.
fn budgeted(limit: u64) -> (CpuBackend, Arc<MemoryBudget>) {
    let budget = MemoryBudget::new(limit);
    let b = CpuBackend::new(CpuConfig {
        budget: Arc::clone(&budget),
        memory_per_context: 1 << 30,
        instruction_budget: 1 << 20,
        ..CpuConfig::default()
    });
    (b, budget)
}

fn out_of_memory<T: std::fmt::Debug>(r: ComputeResult<T>) {
    assert!(
        matches!(r, Err(ComputeError::OutOfMemory(_))),
        "expected OutOfMemory, got {r:?}"
    );
}

/// This process's resident set, in KiB.
fn vm_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn four_contexts_asking_1_gib_each_get_no_more_than_the_vms_256_mib_budget() {
    let (mut b, budget) = budgeted(256 << 20);
    assert_eq!(
        b.attributes().total_memory,
        256 << 20,
        "what a context may hold"
    );
    let before = vm_rss_kib();
    let cs: Vec<_> = (0..4).map(|_| b.context_create().unwrap()).collect();
    assert_eq!(budget.used(), 4 * CONTEXT_RESERVE_BYTES);
    // 1 GiB at once is past the budget: refused before anything is committed.
    for &c in &cs {
        let r = b.mem_alloc(c, 1 << 30);
        assert_eq!(
            r.as_ref().map_err(ComputeError::cuda_status),
            Err(2),
            "{r:?}"
        );
    }
    assert_eq!(budget.used(), 4 * CONTEXT_RESERVE_BYTES);
    // In 16 MiB steps, the four contexts together get what the budget holds, then no more.
    let mut held = Vec::new();
    'fill: loop {
        for &c in &cs {
            match b.mem_alloc(c, 16 << 20) {
                Ok(a) => held.push((c, a)),
                Err(e) => {
                    assert!(matches!(e, ComputeError::OutOfMemory(_)), "{e:?}");
                    break 'fill;
                }
            }
        }
    }
    let step = (16 << 20) + ALLOCATION_RECORD_BYTES;
    let room = (256 << 20) - 4 * CONTEXT_RESERVE_BYTES;
    assert_eq!(held.len() as u64, room / step);
    assert!(budget.used() <= budget.limit());
    let after = vm_rss_kib();
    eprintln!(
        "4 contexts x 1 GiB asked under a 256 MiB budget: {} allocated, VmRSS {} MiB -> {} MiB",
        held.len() * 16,
        before >> 10,
        after >> 10
    );
    // Freeing gives back what the allocation held; a freed block can be allocated again.
    let (c, a) = held.pop().unwrap();
    let used = budget.used();
    b.mem_free(c, a).unwrap();
    assert_eq!(budget.used(), used - step);
    held.push((c, b.mem_alloc(c, 16 << 20).unwrap()));
    // Destroying the contexts gives back everything.
    for c in cs {
        b.context_destroy(c).unwrap();
    }
    assert_eq!(budget.used(), 0);
}

#[test]
fn module_variables_the_device_heap_and_the_context_reserve_are_charged() {
    let (mut b, budget) = budgeted(64 << 20);
    // Past the budget, a context is refused.
    let (mut small, _) = budgeted(CONTEXT_RESERVE_BYTES - 1);
    out_of_memory(small.context_create());
    let c = b.context_create().unwrap();
    let base = budget.used();
    // A module's variables are allocated at load: charged, and given back at unload.
    let big = |bytes: u64| {
        format!(
            ".version 8.5\n.target sm_75\n.address_size 64\n\
             .visible .global .align 8 .b8 big[{bytes}];\n.visible .entry k()\n{{\nret;\n}}\n"
        )
    };
    let m = b.module_load(c, big(1 << 20).as_bytes()).unwrap();
    assert!(budget.used() >= base + (1 << 20));
    b.module_unload(c, m).unwrap();
    assert_eq!(budget.used(), base);
    out_of_memory(b.module_load(c, big(96 << 20).as_bytes()));
    assert_eq!(budget.used(), base, "a refused load holds nothing");
    // The device heap is allocated at the first launch that needs it: charged too.
    let heap = ".version 8.5\n.target sm_75\n.address_size 64\n\
        .extern .func (.param .u64 r) malloc (.param .u64 n);\n\
        .visible .entry k()\n{\n.reg .u64 %m, %n;\nmov.u64 %n, 64;\n\
        { .param .u64 %value_in; .param .u64 %a; st.param.u64 [%a], %n;\n\
          call (%value_in), malloc, (%a); ld.param.u64 %m, [%value_in]; }\nret;\n}\n";
    let m = b.module_load(c, heap.as_bytes()).unwrap();
    let with_module = budget.used();
    // Fill the budget so the heap no longer fits, and the launch fails out of memory.
    let fits = budget.limit() - with_module - ALLOCATION_RECORD_BYTES - DEVICE_HEAP_BYTES;
    let filler = b
        .mem_alloc(
            c,
            fits.next_multiple_of(ALLOCATION_ALIGN) + ALLOCATION_ALIGN,
        )
        .unwrap();
    let f = b.function(c, m, "k").unwrap();
    let launch = KernelLaunch {
        function: f.0,
        grid: [1; 3],
        block: [1; 3],
        shared_bytes: 0,
        stream: DEFAULT_STREAM,
        params: &[],
        cooperative: false,
    };
    out_of_memory(b.launch(c, &launch));
    b.mem_free(c, filler).unwrap();
    b.launch(c, &launch).unwrap();
    assert!(budget.used() >= with_module + DEVICE_HEAP_BYTES);
    b.context_destroy(c).unwrap();
    assert_eq!(budget.used(), 0);
}

/// A kernel that stores what device `malloc` answers for its second parameter's bytes at its
/// first parameter's address.
const MALLOC_PTX: &str = ".version 8.5\n.target sm_75\n.address_size 64\n\
    .extern .func (.param .u64 r) malloc (.param .u64 n);\n\
    .visible .entry k(.param .u64 out, .param .u64 n)\n{\n.reg .u64 %m, %n, %o;\n\
    ld.param.u64 %o, [out];\nld.param.u64 %n, [n];\n\
    { .param .u64 %value_in; .param .u64 %a; st.param.u64 [%a], %n;\n\
      call (%value_in), malloc, (%a); ld.param.u64 %m, [%value_in]; }\n\
    st.u64 [%o], %m;\nret;\n}\n";

/// What `malloc(bytes)` answers in a fresh launch of [`MALLOC_PTX`]'s kernel.
fn device_malloc(b: &mut CpuBackend, c: ContextId, f: FunctionId, bytes: u64) -> u64 {
    let out = b.mem_alloc(c, 8).unwrap();
    let params: Vec<u8> = [out, bytes].iter().flat_map(|v| v.to_le_bytes()).collect();
    let launch = KernelLaunch {
        function: f,
        grid: [1; 3],
        block: [1; 3],
        shared_bytes: 0,
        stream: DEFAULT_STREAM,
        params: &params,
        cooperative: false,
    };
    b.launch(c, &launch).unwrap();
    let mut got = [0; 8];
    b.copy_dtoh(c, &mut got, out, DEFAULT_STREAM).unwrap();
    b.mem_free(c, out).unwrap();
    u64::from_le_bytes(got)
}

#[test]
fn the_device_heap_takes_the_size_set_before_its_first_use_and_keeps_it() {
    use crate::compute::memory::{MAX_DEVICE_HEAP_BYTES, check_heap_size};
    let (mut b, budget) = budgeted(512 << 20);
    let c = b.context_create().unwrap();
    invalid_handle(b.set_heap_size(ContextId(c.0 + 1), 1 << 20));
    invalid_value(b.set_heap_size(c, MAX_DEVICE_HEAP_BYTES + 1));
    assert!(check_heap_size(MAX_DEVICE_HEAP_BYTES).is_ok());
    b.set_heap_size(c, 128 << 20).unwrap();
    let m = b.module_load(c, MALLOC_PTX.as_bytes()).unwrap();
    let f = b.function(c, m, "k").unwrap().0;
    let before = budget.used();
    // 64 MiB does not fit the default 8 MiB heap but fits the 128 MiB one, charged when made.
    assert_ne!(device_malloc(&mut b, c, f, 64 << 20), 0);
    assert!(budget.used() >= before + (128 << 20));
    assert_eq!(device_malloc(&mut b, c, f, 96 << 20), 0, "the heap is full");
    invalid_value(b.set_heap_size(c, 256 << 20));
    invalid_value(b.set_heap_size(c, 128 << 20));
    // Another context keeps the default size; a heap of 0 bytes answers NULL.
    let d = b.context_create().unwrap();
    let m = b.module_load(d, MALLOC_PTX.as_bytes()).unwrap();
    let g = b.function(d, m, "k").unwrap().0;
    assert_eq!(
        device_malloc(&mut b, d, g, 16 << 20),
        0,
        "the default 8 MiB heap"
    );
    let e = b.context_create().unwrap();
    b.set_heap_size(e, 0).unwrap();
    let m = b.module_load(e, MALLOC_PTX.as_bytes()).unwrap();
    let h = b.function(e, m, "k").unwrap().0;
    assert_eq!(device_malloc(&mut b, e, h, 16), 0, "an empty heap");
    [c, d, e]
        .into_iter()
        .for_each(|x| b.context_destroy(x).unwrap());
    assert_eq!(budget.used(), 0);
}

#[test]
fn two_backends_given_one_budget_share_it() {
    let (mut one, budget) = budgeted(64 << 20);
    let mut two = CpuBackend::new(CpuConfig {
        budget: Arc::clone(&budget),
        ..CpuConfig::default()
    });
    let c1 = one.context_create().unwrap();
    let c2 = two.context_create().unwrap();
    let a = one.mem_alloc(c1, 32 << 20).unwrap();
    out_of_memory(two.mem_alloc(c2, 32 << 20));
    one.mem_free(c1, a).unwrap();
    two.mem_alloc(c2, 32 << 20).unwrap();
    drop(two);
    assert_eq!(
        budget.used(),
        CONTEXT_RESERVE_BYTES,
        "a dropped backend gives back all"
    );
}
