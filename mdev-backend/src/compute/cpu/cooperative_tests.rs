//! Cooperative launches on the CPU backend, through the backend trait, on both engines: a
//! grid barrier as CUDA's cooperative groups make it (the workspace `%envreg1`/`%envreg2`
//! give, a release add by each block's first thread, acquire loads until the barrier word's
//! top bit flips), the refusal of a grid that cannot be resident at once, and a grid whose
//! blocks wait forever stopped by the deadline and by a stop.

use std::time::Duration;

use super::*;
use crate::compute::DeviceMemory;

/// `sync_demo(out, rounds)`: each block adds `ctaid + 1` to `out[ctaid]` from every thread,
/// then all blocks meet at the grid barrier `rounds` times (the first block's arrival
/// counts `0x80000000 - (blocks - 1)`, every other block's 1, so the word's top bit flips
/// when the last block arrives), then every block sums what all blocks wrote and its first
/// thread stores the sum in `out[nctaid + ctaid]`. With `rounds` past what is reached
/// (`forever`), block 0 waits for arrivals that never come.
const GRID_SYNC: &str = "\
.version 8.5
.target sm_75
.address_size 64
.visible .entry sync_demo(.param .u64 out, .param .u32 rounds, .param .u32 forever)
{
.reg .pred %p<6>;
.reg .b32 %r<24>;
.reg .b64 %rd<12>;
mov.u32 %r1, %envreg1;
mov.u32 %r2, %envreg2;
cvt.u64.u32 %rd1, %r1;
cvt.u64.u32 %rd2, %r2;
shl.b64 %rd1, %rd1, 32;
or.b64 %rd1, %rd1, %rd2;
add.u64 %rd3, %rd1, 4;
ld.param.u64 %rd4, [out];
ld.param.u32 %r20, [rounds];
ld.param.u32 %r21, [forever];
mov.u32 %r3, %ctaid.x;
mov.u32 %r4, %nctaid.x;
mov.u32 %r5, %tid.x;
mul.wide.u32 %rd5, %r3, 4;
add.u64 %rd6, %rd4, %rd5;
add.u32 %r6, %r3, 1;
atom.global.add.u32 %r7, [%rd6], %r6;
ROUND:
setp.eq.u32 %p4, %r20, 0;
@%p4 bra SUM;
sub.u32 %r20, %r20, 1;
bar.sync 0;
setp.ne.u32 %p1, %r5, 0;
@%p1 bra MET;
setp.eq.u32 %p2, %r3, 0;
sub.u32 %r8, %r4, 1;
add.u32 %r8, %r8, %r21;
mov.u32 %r9, 0x80000000;
sub.u32 %r9, %r9, %r8;
selp.u32 %r10, %r9, 1, %p2;
atom.add.release.gpu.u32 %r11, [%rd3], %r10;
SPIN:
ld.acquire.gpu.u32 %r12, [%rd3];
xor.b32 %r13, %r12, %r11;
and.b32 %r13, %r13, 0x80000000;
setp.eq.u32 %p3, %r13, 0;
@%p3 bra SPIN;
MET:
bar.sync 0;
bra ROUND;
SUM:
mov.u32 %r14, 0;
mov.u32 %r15, 0;
mov.u64 %rd7, %rd4;
LOOP:
ld.global.u32 %r16, [%rd7];
add.u32 %r15, %r15, %r16;
add.u64 %rd7, %rd7, 4;
add.u32 %r14, %r14, 1;
setp.lt.u32 %p5, %r14, %r4;
@%p5 bra LOOP;
setp.ne.u32 %p1, %r5, 0;
@%p1 bra DONE;
add.u32 %r17, %r4, %r3;
mul.wide.u32 %rd8, %r17, 4;
add.u64 %rd9, %rd4, %rd8;
st.global.u32 [%rd9], %r15;
DONE:
ret;
}
";

const ENGINES: [ptx::Engine; 2] = [ptx::Engine::Interpreter, ptx::Engine::Compiled];

fn backend(engine: ptx::Engine, threads: usize) -> (CpuBackend, ContextId, FunctionId) {
    let mut be = CpuBackend::new(CpuConfig {
        memory_per_context: 1 << 20,
        threads,
        engine,
        ..CpuConfig::default()
    });
    let ctx = be.context_create().unwrap();
    let m = be.module_load(ctx, GRID_SYNC.as_bytes()).unwrap();
    let (f, _) = be.function(ctx, m, "sync_demo").unwrap();
    (be, ctx, f)
}

fn params(out: u64, rounds: u32, forever: u32) -> Vec<u8> {
    [
        &out.to_le_bytes()[..],
        &rounds.to_le_bytes(),
        &forever.to_le_bytes(),
    ]
    .concat()
}

fn launch(f: FunctionId, blocks: u32, params: &[u8], cooperative: bool) -> KernelLaunch<'_> {
    KernelLaunch {
        function: f,
        grid: [blocks, 1, 1],
        block: [64, 1, 1],
        shared_bytes: 0,
        stream: DEFAULT_STREAM,
        params,
        cooperative,
    }
}

fn words(be: &mut CpuBackend, ctx: ContextId, at: u64, n: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; n * 4];
    be.copy_dtoh(ctx, &mut bytes, at, DEFAULT_STREAM).unwrap();
    bytes
        .chunks(4)
        .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
        .collect()
}

#[test]
fn blocks_of_a_cooperative_launch_meet_at_grid_barriers_and_read_each_others_results() {
    const BLOCKS: u32 = 6;
    for engine in ENGINES {
        // One host thread configured: a cooperative launch still runs every block at once.
        let (mut be, ctx, f) = backend(engine, 1);
        let out = be.mem_alloc(ctx, 4 * 2 * u64::from(BLOCKS)).unwrap();
        be.memset_d8(ctx, out, 0, 4 * 2 * u64::from(BLOCKS), DEFAULT_STREAM)
            .unwrap();
        let p = params(out, 3, 0);
        be.launch(ctx, &launch(f, BLOCKS, &p, true)).unwrap();
        let got = words(&mut be, ctx, out, 2 * BLOCKS as usize);
        let each: Vec<u32> = (1..=BLOCKS).map(|b| b * 64).collect();
        let sum: u32 = each.iter().sum();
        assert_eq!(got[..BLOCKS as usize], each, "{engine:?}");
        assert_eq!(
            got[BLOCKS as usize..],
            vec![sum; BLOCKS as usize],
            "{engine:?}: every block saw every block's result after the barrier"
        );
        // The workspace went with the launch: a second launch starts from a zeroed barrier.
        be.memset_d8(ctx, out, 0, 4 * 2 * u64::from(BLOCKS), DEFAULT_STREAM)
            .unwrap();
        be.launch(ctx, &launch(f, BLOCKS, &p, true)).unwrap();
        assert_eq!(
            words(&mut be, ctx, out, BLOCKS as usize),
            each,
            "{engine:?}"
        );
        // Outside a cooperative launch the workspace address is null, as `grid.is_valid()`
        // reports on a GPU: the barrier's address faults.
        let e = be.launch(ctx, &launch(f, 2, &p, false)).unwrap_err();
        assert_eq!(e.cuda_status(), 700, "{engine:?}: {e}");
    }
}

#[test]
fn the_compiler_runs_a_grid_barrier_with_envreg_itself() {
    let m = ptx::Module::parse(GRID_SYNC).unwrap();
    let mut mem = DeviceMemory::new(1 << 20);
    let out = mem.alloc(64).unwrap();
    let ws = mem.alloc(ptx::GRID_WORKSPACE_BYTES).unwrap();
    let p = params(out, 2, 0);
    let budget = MemoryBudget::new(1 << 30);
    let l = Launch {
        grid: [4, 1, 1],
        block: [64, 1, 1],
        dynamic_shared_bytes: 0,
        params: &p,
        symbols: &[],
        heap: None,
        instruction_budget: 1 << 30,
        threads: 1,
        interrupt: None,
        budget: &budget,
        engine: ptx::Engine::Compiled,
        cooperative: Some(ws),
    };
    let stats = ptx::launch(&m, "sync_demo", &l, &mem).unwrap();
    assert!(stats.compiled, "compiled code ran it, not the interpreter");
    assert_eq!(stats.threads, 4, "a host thread per block");
    let mut sums = [0u8; 16];
    mem.read(out + 16, &mut sums).unwrap();
    assert!(
        sums.chunks(4).all(|w| w == (640u32).to_le_bytes()),
        "{sums:?}"
    );
}

#[test]
fn a_grid_larger_than_what_is_resident_at_once_is_refused_with_720_and_not_sticky() {
    for engine in ENGINES {
        // Two multiprocessors; 64-thread blocks fit 16 on each (Turing's block limit).
        let (mut be, ctx, f) = backend(engine, 2);
        assert_eq!(be.attributes().multiprocessors, 2);
        let out = be.mem_alloc(ctx, 4 * 2 * 64).unwrap();
        let p = params(out, 1, 0);
        let e = be.launch(ctx, &launch(f, 33, &p, true)).unwrap_err();
        assert_eq!(e.cuda_status(), 720, "{engine:?}: {e}");
        assert!(!e.is_sticky());
        // Exactly what is resident at once runs.
        be.launch(ctx, &launch(f, 32, &p, true)).unwrap();
        let got = words(&mut be, ctx, out, 64);
        assert_eq!(got[32..], vec![64 * (32 * 33 / 2); 32], "{engine:?}");
        // Dynamic shared memory lowers it: 40 KiB each leaves one block per multiprocessor.
        let mut big = launch(f, 3, &p, true);
        big.shared_bytes = 40 << 10;
        let e = be.launch(ctx, &big).unwrap_err();
        assert_eq!(e.cuda_status(), 720, "{engine:?}: {e}");
        // More shared memory than a block may have is the launch's own refusal.
        big.shared_bytes = ptx::MAX_SHARED_BYTES + 1;
        let e = be.launch(ctx, &big).unwrap_err();
        assert_eq!(e.cuda_status(), 701, "{engine:?}: {e}");
        // The same grid launched normally is not bounded by residency.
        be.launch(ctx, &launch(f, 33, &params(out, 0, 0), false))
            .unwrap();
    }
}

#[test]
fn the_executor_bounds_the_blocks_of_a_cooperative_launch() {
    let m = ptx::Module::parse(GRID_SYNC).unwrap();
    let mut mem = DeviceMemory::new(1 << 20);
    let out = mem.alloc(64).unwrap();
    let p = params(out, 0, 0);
    let budget = MemoryBudget::new(1 << 30);
    for engine in ENGINES {
        let l = Launch {
            grid: [ptx::MAX_COOPERATIVE_BLOCKS as u32 + 1, 1, 1],
            block: [32, 1, 1],
            dynamic_shared_bytes: 0,
            params: &p,
            symbols: &[],
            heap: None,
            instruction_budget: 1 << 30,
            threads: 1,
            interrupt: None,
            budget: &budget,
            engine,
            cooperative: Some(out),
        };
        let e = ptx::launch(&m, "sync_demo", &l, &mem).unwrap_err();
        assert_eq!(e.cuda_status(), 720, "{engine:?}: {e}");
    }
}

#[test]
fn a_grid_whose_blocks_wait_forever_stops_at_the_deadline_and_on_stop() {
    for engine in ENGINES {
        let mut be = CpuBackend::new(
            CpuConfig {
                memory_per_context: 1 << 20,
                threads: 2,
                engine,
                ..CpuConfig::default()
            }
            .with_request_time(Duration::from_millis(300)),
        );
        let ctx = be.context_create().unwrap();
        let m = be.module_load(ctx, GRID_SYNC.as_bytes()).unwrap();
        let (f, _) = be.function(ctx, m, "sync_demo").unwrap();
        let out = be.mem_alloc(ctx, 64).unwrap();
        let p = params(out, 1, 1);
        let interrupt = be.interrupt().unwrap();
        let e = interrupt
            .request(|| be.launch(ctx, &launch(f, 4, &p, true)))
            .unwrap_err();
        assert_eq!(e.cuda_status(), 702, "{engine:?}: {e}");
        assert!(e.to_string().contains("time limit"), "{engine:?}: {e}");

        let ctx = be.context_create().unwrap();
        let m = be.module_load(ctx, GRID_SYNC.as_bytes()).unwrap();
        let (f, _) = be.function(ctx, m, "sync_demo").unwrap();
        let out = be.mem_alloc(ctx, 64).unwrap();
        let p = params(out, 1, 1);
        let done = std::sync::atomic::AtomicBool::new(false);
        let e = std::thread::scope(|s| {
            s.spawn(|| {
                // Until the launch has ended: a stop before it began is forgotten when it
                // begins.
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(50));
                    interrupt.stop();
                }
            });
            // No deadline: only the stop ends it.
            let e = be.launch(ctx, &launch(f, 4, &p, true)).unwrap_err();
            done.store(true, std::sync::atomic::Ordering::Release);
            e
        });
        assert_eq!(e.cuda_status(), 702, "{engine:?}: {e}");
        assert!(e.to_string().contains("cancelled"), "{engine:?}: {e}");
    }
}

#[test]
fn envreg_names_0_to_31_only() {
    let kernel = |reg: &str| {
        format!(
            ".version 8.5\n.target sm_75\n.address_size 64\n.visible .entry k()\n{{\n\
             .reg .b32 %r<2>;\nmov.u32 %r1, {reg};\nret;\n}}\n"
        )
    };
    for ok in ["%envreg0", "%envreg1", "%envreg2", "%envreg31"] {
        ptx::Module::parse(&kernel(ok)).unwrap();
    }
    for bad in [
        "%envreg32",
        "%envreg01",
        "%envreg",
        "%envreg+1",
        "%envreg1a",
    ] {
        assert!(ptx::Module::parse(&kernel(bad)).is_err(), "{bad}");
    }
}
