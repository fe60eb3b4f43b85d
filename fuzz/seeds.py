#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into fuzz/corpus/<target>/ (docs/FUZZING.md).

Each seed is a small, well-formed input in the byte layout its target reads (see the target's
source in fuzz_targets/), so the fuzzer starts from inputs that reach deep into the code under
test. Run it from anywhere: `python3 fuzz/seeds.py`. The output is deterministic.
"""
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def u8(v): return struct.pack("<B", v)
def u16(v): return struct.pack("<H", v)
def u32(v): return struct.pack("<I", v)
def u64(v): return struct.pack("<Q", v)
def chunk(b): assert len(b) < 256; return u8(len(b)) + b


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- scheduler protocol (scheduler/daemon/src/proto.rs) -------------------------------------
MAGIC = 0x31534756
TO_DEVICE = 0x8000


def packet(kind, payload):
    return u32(MAGIC) + u16(kind) + u16(0) + u32(len(payload)) + payload


def text(s): return u16(len(s)) + s.encode()
def hello(name, pid, qemu=0): return packet(1, u32(2) + text(name) + u32(pid) + u32(qemu))
def submit(group, exec_=0, cost=1000):
    return packet(2, u64(group) + u32(0) + u8(0) + u64(7) + u64(cost) + u8(exec_))
def completed(group, start, finish): return packet(4, u64(group) + u64(start) + u64(finish))
def cancel(group): return packet(7, u64(group))


def framed(*packets): return b"".join(u16(len(p)) + p for p in packets)


write("sched_proto", "hello_submit", framed(hello("vm0", 10), submit(1), completed(1, 5, 9)))
write("sched_proto", "frame_bye_cancel", framed(packet(5, b""), cancel(3), packet(6, b"")))
write("sched_proto", "to_device", framed(packet(TO_DEVICE | 1, u32(2) + u32(0)),
                                         packet(TO_DEVICE | 2, u64(1)),
                                         packet(TO_DEVICE | 4, u64(1000) + u64(0)),
                                         packet(TO_DEVICE | 9, u32(1) + text("bad"))))

# --- daemon protocol with several connections (fuzz_targets/daemon_proto.rs) ----------------
def d_connect(pid=0): return u8(0) + u8(0) + u8(pid)
def d_close(pick): return u8(1) + u8(pick)
def d_raw(pick, p): return u8(2) + u8(pick) + chunk(p)
def d_hello(pick, vm, pid, qemu=0): return u8(3) + u8(pick) + u8(vm) + u8(pid) + u8(qemu)
def d_submit(pick, group, sim=0):
    return u8(4) + u8(pick) + u8(group) + u8(0) + u8(0) + u8(1) + u16(5) + u8(sim)
def d_completed(pick, group): return u8(5) + u8(pick) + u16(0) + u16(3) + u8(group)
def d_other(pick, group, which): return u8(6) + u8(pick) + u8(group) + u8(which)
def d_time(us): return u8(7) + u8(0) + u32(us * 1000)


write("daemon_proto", "two_vms_one_never_completes",
      u8(0) + d_connect() + d_connect() + d_hello(0, 0, 1) + d_hello(1, 1, 2)
      + d_submit(0, 1) + d_submit(1, 1) + d_completed(0, 1) + d_time(100) + d_close(0))
write("daemon_proto", "simulated_and_cancel",
      u8(1) + d_connect() + d_hello(0, 2, 3) + d_submit(0, 4, sim=1) + d_time(5000)
      + d_submit(0, 5) + d_other(0, 5, 0) + d_other(0, 0, 1) + d_other(0, 0, 2))
write("daemon_proto", "raw_and_squatter",
      u8(0) + d_connect() + d_connect() + d_raw(0, hello("vm1", 5)) + d_hello(1, 1, 5)
      + d_raw(0, submit(9)) + d_other(1, 9, 3))

# --- control requests (fuzz_targets/control_requests.rs) ------------------------------------
def lines(*reqs):
    out = b""
    for r in reqs:
        line = (json.dumps(r) if isinstance(r, dict) else r).encode() + b"\n"
        out += u16(1) + chunk(line)
    return out


write("control_requests", "list_stats", lines({"cmd": "list"}, {"cmd": "stats"}))
write("control_requests", "params_focus",
      lines({"cmd": "set-params", "vm": "vm0", "params": {"priority": 3}},
            {"cmd": "focus", "vm": "vm1"}, "weight=4", "reserve=100/1000/pe"))
write("control_requests", "policy_create",
      lines({"cmd": "set-policy", "policy": {"policy": "fair"}},
            {"cmd": "create", "name": "a", "socket": "/run/a.sock", "args": ["--width", "800"]},
            {"cmd": "destroy", "name": "a"}))

# --- the daemon's HTTP requests (fuzz_targets/http_head.rs) ---------------------------------
write("http_head", "get_metrics", chunk(b"GET /metrics HTTP/1.1\r\nHost: h\r\n") + chunk(b"\r\n"))
write("http_head", "post", chunk(b"POST / HTTP/1.0\n\n"))
write("http_head", "trickle", b"".join(chunk(bytes([c])) for c in b"GET / HTTP/1.1\r\n\r\n"))
# The dashboard's requests (the target's listener is 127.0.0.1:9100 with token 0123456789abcdef).
BODY = b'{"vm":"a","params":{"priority":3,"weight":512}}'
write("http_head", "dashboard_params",
      chunk(b"POST /api/params HTTP/1.1\r\nHost: 127.0.0.1:9100\r\nX-Vgpu-Token: 0123456789abcdef\r\n")
      + chunk(b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY))
      + chunk(BODY[:20]) + chunk(BODY[20:]))
write("http_head", "dashboard_events", chunk(b"GET /events HTTP/1.1\r\nHost: localhost:9100\r\n\r\n"))

# --- the host-guest control channel (fuzz_targets/guest_control.rs) -----------------------
# Pieces: a direction byte (even: the agent's lines to the host; odd: the host's requests to
# the agent), then a chunk.
def to_host(b): return u8(0) + chunk(b)
def to_agent(b): return u8(1) + chunk(b)
write("guest_control", "agent_reports",
      to_host(b'HELLO 1\nSTARTED load\nSUMMARY load {"kind":"summary","fps":59.8}\n')
      + to_host(b'EXITED load 0\nERROR - unknown message "X"\nBYE\n'))
write("guest_control", "host_requests", to_agent(b"PING\nSTART job 12\nvgpu-load x\n")
      + to_agent(b"STOP job\nQUIT\n"))
write("guest_control", "split_lines", to_host(b"SUMMARY a par") + to_agent(b"START b 3\nab")
      + to_host(b"tial\nEXITED a 143\n") + to_agent(b"cPING\n"))

# --- cgroup and /proc parsers (fuzz_targets/cgroup_proc.rs) ---------------------------------
write("cgroup_proc", "proc_cgroup_v2", u8(0) + b"0::/machine.slice/vm1.scope\n")
write("cgroup_proc", "proc_cgroup_v1", u8(0) + b"12:cpu,cpuacct:/a/b\n3:memory:/m\n0::/x\n")
write("cgroup_proc", "stat", u8(1) + b"1234 (CPU 0/KVM) R 1 2 3 4 5")
write("cgroup_proc", "schedstat", u8(2) + b"123456 789 10\n")
write("cgroup_proc", "vcpu_name", u8(3) + b"CPU 12/TCG")

# --- virtio-gpu commands (fuzz_targets/gpu_commands.rs) -------------------------------------
def hdr(ty, fence=0, ctx=0): return u32(ty) + u32(1 if fence else 0) + u64(fence) + u32(ctx) + u8(0) + b"\0" * 3
def rect(x, y, w, h): return u32(x) + u32(y) + u32(w) + u32(h)
def g_op(op, buf): return u8(op) + u16(len(buf)) + buf


CREATE_2D = hdr(0x101) + u32(1) + u32(1) + u32(64) + u32(64)
BACKING = hdr(0x106) + u32(1) + u32(2) + u64(0x1000) + u32(8192) + u32(0) + u64(0x4000) + u32(8192) + u32(0)
write("gpu_commands", "display_2d",
      u8(0) + g_op(0, hdr(0x100)) + g_op(0, CREATE_2D) + g_op(3, b"\x11" * 64) + g_op(0, BACKING)
      + g_op(0, hdr(0x105) + rect(0, 0, 64, 64) + u64(0) + u32(1) + u32(0))
      + g_op(0, hdr(0x103) + rect(0, 0, 64, 64) + u32(0) + u32(1))
      + g_op(0, hdr(0x104, fence=5) + rect(0, 0, 64, 64) + u32(1) + u32(0))
      + g_op(0, hdr(0x10a) + u32(0) + u32(0)) + g_op(0, hdr(0x102) + u32(1) + u32(0)))
write("gpu_commands", "cursor",
      u8(0) + g_op(0, CREATE_2D) + g_op(1, hdr(0x300) + u32(0) + u32(10) + u32(20) + u32(0)
                                        + u32(1) + u32(2) + u32(3) + u32(0))
      + g_op(1, hdr(0x301) + u32(0) + u32(30) + u32(40) + u32(0) + u32(0) * 4))
write("gpu_commands", "capsets_3d",
      u8(1) + g_op(0, hdr(0x108) + u32(0) + u32(0)) + g_op(0, hdr(0x109) + u32(1) + u32(0))
      + g_op(0, hdr(0x200, ctx=1) + u32(7) + u32(0) + b"name" + b"\0" * 60)
      + g_op(2, u32(1) * 8))

# --- PCI config and virtio-pci (fuzz_targets/pci_config.rs) ---------------------------------
def p_op(kind, width_index, offset, value=0): return u8(kind | (width_index << 4)) + u16(offset) + u64(value)


write("pci_config", "probe",
      u8(0) + p_op(1, 2, 0x00) + p_op(1, 1, 0x06) + p_op(1, 0, 0x34) + p_op(0, 1, 0x04, 0x6)
      + p_op(1, 2, 0x40) + p_op(3, 2, 0x04) + p_op(3, 1, 0x12))
write("pci_config", "driver_init",
      u8(0) + p_op(2, 0, 0x14, 0) + p_op(2, 0, 0x14, 3) + p_op(2, 2, 0x00, 1) + p_op(3, 2, 0x04)
      + p_op(2, 2, 0x08, 1) + p_op(2, 2, 0x0c, 1) + p_op(2, 0, 0x14, 11) + p_op(2, 1, 0x16, 0)
      + p_op(2, 1, 0x18, 16) + p_op(2, 3, 0x20, 0) + p_op(2, 3, 0x28, 0x1000)
      + p_op(2, 3, 0x30, 0x2000) + p_op(2, 1, 0x1c, 1) + p_op(2, 0, 0x14, 15)
      + p_op(2, 1, 0x3000, 0) + p_op(3, 2, 0x2000) + p_op(5, 0, 1))
write("pci_config", "ready_then_reset", u8(1) + u64(0) + p_op(4, 0, 0) + p_op(5, 0, 0) + p_op(4, 0, 1))

# --- DMA and interrupts (fuzz_targets/dma_irq.rs) -------------------------------------------
def m_map(page, pages, off, fd=True, writable=True):
    return u8(0 | (0 if fd else 0x10) | (0 if writable else 0x20)) + u16(page) + u16(pages) + u16(off)
def m_unmap(page, pages): return u8(1) + u16(page) + u16(pages)
def m_irqs(index, sel, start, count, fds): return u8(3) + u8(index) + u8(sel) + u8(start) + u8(count) + u8(fds)


write("dma_irq", "maps", u64(0) + m_map(0x10, 4, 0) + m_map(0x12, 4, 8) + m_map(0x20, 2, 0, fd=False)
      + m_unmap(0x10, 2) + m_unmap(0x10, 4) + u8(2))
write("dma_irq", "msix_intx", u64(0) + m_irqs(2, 8, 0, 2, 2) + m_irqs(0, 8, 0, 1, 1)
      + m_irqs(0, 5, 0, 1, 0) + u8(4) + m_irqs(2, 2, 0, 0, 0) + u8(5) + u8(0) + u16(0) + chunk(b""))

# --- virtqueues over guest memory (fuzz_targets/virtqueue.rs) -------------------------------
def desc(addr, length, flags, nxt): return u64(addr) + u32(length) + u16(flags) + u16(nxt)
def ram(addr, data): return u8(0) + u16(addr) + chunk(data)
def publish(q, n): return u8(2 | (q << 7)) + u8(n)
def kick(q): return u8(3 | (q << 7))


NEXT, WRITE, INDIRECT = 1, 2, 4
write("virtqueue", "display_info",
      u64(0) + ram(0x6000, hdr(0x100)) + ram(0, desc(0x6000, 24, NEXT, 1) + desc(0x7000, 512, WRITE, 0))
      + publish(0, 1) + kick(0))
write("virtqueue", "cursor_queue",
      u64(0) + ram(0x8000, hdr(0x301) + b"\0" * 32) + ram(0x3000, desc(0x8000, 56, 0, 0))
      + publish(1, 1) + kick(1))
write("virtqueue", "indirect_and_loop",
      u64(1 << 28) + ram(0x6000, hdr(0x100)) + ram(0x9000, desc(0x6000, 24, NEXT, 1) + desc(0x7000, 512, WRITE, 0))
      + ram(0, desc(0x9000, 32, INDIRECT, 0) + desc(0x6000, 24, NEXT, 1)) + ram(0x1004, u16(0) + u16(1))
      + publish(0, 2) + kick(0))

# --- vfio-user stream (fuzz_targets/vfio_user_stream.rs) ------------------------------------
def msg(mid, cmd, payload, flags=0): return u16(mid) + u16(cmd) + u32(16 + len(payload)) + u32(flags) + u32(0) + payload


CAPS = json.dumps({"capabilities": {"max_msg_fds": 16, "max_data_xfer_size": 1048576}}).encode() + b"\0"
VERSION = msg(0, 1, u16(0) + u16(1) + CAPS)
CONFIG, BAR4 = 7, 4
def rd(mid, region, off, count): return msg(mid, 9, u64(off) + u32(region) + u32(count))
def wr(mid, region, off, data): return msg(mid, 10, u64(off) + u32(region) + u32(len(data)) + data)


write("vfio_user_stream", "version_info",
      VERSION + msg(1, 4, u32(16) + u32(0) + u32(0) + u32(0)) + msg(2, 5, u32(32) + u32(0) + u32(CONFIG) + u32(0) * 5)
      + msg(3, 7, u32(16) + u32(0) + u32(2) + u32(0)))
write("vfio_user_stream", "config_and_bar",
      VERSION + rd(1, CONFIG, 0, 4) + wr(2, CONFIG, 4, u16(6)) + rd(3, BAR4, 0x12, 2)
      + wr(4, BAR4, 0x14, u8(3)) + wr(5, BAR4, 0x3000, u16(0)) + msg(6, 13, b""))
write("vfio_user_stream", "dma_without_fd",
      VERSION + msg(1, 2, u32(32) + u32(3) + u64(0) + u64(0x100000) + u64(0x10000))
      + msg(2, 3, u32(24) + u32(0) + u64(0x100000) + u64(0x10000))
      + msg(3, 8, u32(20) + u32(0x24) + u32(2) + u32(0) + u32(0)))


# --- compute module images (fuzz_targets/compute_module.rs) -------------------------------
PTX_HEAD = ".version 8.5\n.target sm_75\n.address_size 64\n"
PTX_ADD = PTX_HEAD + """.visible .entry add(.param .u64 p, .param .u32 n)
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [p];
	ld.param.u32 %r1, [n];
	mov.u32 %r2, %tid.x;
	setp.ge.u32 %p1, %r2, %r1;
	@%p1 bra $L__end;
	mul.wide.u32 %rd2, %r2, 4;
	add.s64 %rd3, %rd1, %rd2;
	atom.global.add.u32 %r3, [%rd3], 1;
$L__end:
	ret;
}
"""
PTX_SHARED = PTX_HEAD + """.shared .align 4 .b8 s[256];
.visible .entry sh()
{
	.reg .b32 %r<6>;
	mov.u32 %r1, %tid.x;
	shl.b32 %r2, %r1, 2;
	mov.u32 %r3, s;
	add.s32 %r4, %r3, %r2;
	st.shared.u32 [%r4], %r1;
	bar.sync 0;
	shfl.sync.bfly.b32 %r5, %r1, 1, 31, -1;
	ret;
}
"""


def fatbin_of(ptx):
    payload = ptx.encode() + b"\0" * (8 - len(ptx) % 8)
    entry = u16(1) + u16(0x101) + u32(64) + u64(len(payload)) + u32(len(ptx)) + u32(0) \
        + u16(5) + u16(8) + u32(75) + u32(0) + u32(0) + u64(0x11) + u64(0) + u64(0) + payload
    return u32(0xBA55ED50) + u16(1) + u16(16) + u64(len(entry)) + entry


# The first byte is the mode (its value modulo 3): 0 the image itself; 1 a fat binary and 2 a
# deeply nested PTX module, both built by the generators in src/compute.rs from the layout
# after it (documented there). The committed ptx_linked seed carries its mode byte too.
RAW, FATBIN, DEEP_PTX = 0, 1, 2
write("compute_module", "ptx_add", u8(RAW) + PTX_ADD.encode())
write("compute_module", "ptx_shared", u8(RAW) + PTX_SHARED.encode())
write("compute_module", "fatbin_add", u8(RAW) + fatbin_of(PTX_ADD))


def deep(depth, repeats, picks, kernels=1):
    """deep_ptx's layout: kernels, then per kernel depth, repeats and instruction picks."""
    return u8(kernels - 1) + (u16(depth) + u16(repeats) + u8(len(picks)) + bytes(picks)) * kernels


# Picks index INSTRUCTIONS: 0 mov, 1 add, 5 setp, 6 @p bra (a loop the budget ends), 8 ld.param.
write("compute_module", "deep_scopes", u8(DEEP_PTX) + deep(2000, 1, [0, 1, 5, 6]))
write("compute_module", "many_instructions", u8(DEEP_PTX) + deep(3, 500, [0, 1, 2, 3, 4, 9], kernels=2))

# fatbin's entry selector: bit 0 ELF, bits 1-2 compression (1 LZ4, 2 Zstandard), bit 3 bomb,
# bits 4-5 declared size (0 exact, 1 more by a u16, 2 less by a u16, 3 any u32), bit 6 a
# stored size past the payload. Each entry: selector, architecture, then its bytes.
ELF, LZ4, ZSTD, BOMB, MORE, ANY, STORED_PAST = 0x01, 0x02, 0x04, 0x08, 0x10, 0x30, 0x40
write("compute_module", "fatbin_lz4_zstd_elf",
      u8(FATBIN) + u8(0) + u8(3 - 1)
      + u8(LZ4) + u8(75) + deep(200, 4, [0, 1, 5, 6])
      + u8(ZSTD) + u8(80) + deep(2, 500, [0, 1, 2, 9, 10])
      + u8(ELF) + u8(75) + chunk(b"\x7fELF" + bytes(40)))
write("compute_module", "fatbin_bombs",
      u8(FATBIN) + u8(0) + u8(4 - 1)
      + u8(LZ4 | BOMB) + u8(60) + u32(100 << 20)
      + u8(ZSTD | BOMB | ANY) + u8(61) + u32(200 << 20) + u32(4096)
      + u8(LZ4 | BOMB | MORE) + u8(62) + u32(40 << 20) + u16(999)
      + u8(ZSTD | STORED_PAST) + u8(75) + deep(1, 1, [0]) + u8(7))
# Eight Zstandard entries of just under 64 MiB of spaces each, declaring 4 KiB: the code before
# the bounded load decompressed all of them at once (600 MiB, past fuzz.sh's RSS limit).
write("compute_module", "fatbin_zstd_bombs_lying",
      u8(FATBIN) + u8(0) + u8(8 - 1)
      + (u8(ZSTD | BOMB | ANY) + u8(75) + u32((64 << 20) - 100) + u32(4096)) * 8)
write("compute_module", "fatbin_link",
      u8(FATBIN) + u8(1) + u8(2 - 1)
      + u8(0) + u8(75) + deep(10, 10, [0, 1, 6])
      + u8(ZSTD | BOMB) + u8(75) + u32(1 << 20))


# --- compute wire (fuzz_targets/compute_wire.rs) --------------------------------------------
# The first byte is the mode: even, the stream itself (the committed seeds attributes,
# huge-grid and session carry a 0); odd, nested_batches' layout (src/compute.rs: depth,
# requests per level, the nested batch's place, extra items declared, the requests), then
# set-up messages served before the nested batch.
def wire_msg(op, fields=b""): body = u16(op) + fields; return u32(len(body)) + body


CONTEXT_CREATE = wire_msg(2)
SYNC_CTX1 = u16(4) + chunk(u32(1))        # ContextSynchronize { ctx: 1 }, a batchable request


def nested(depth, leaves, at=0, lie=0):
    return u8(1) + u16(depth) + u8(len(leaves)) + u8(at) + u8(lie) + b"".join(leaves)


write("compute_wire", "nested_20000", nested(20000, [SYNC_CTX1]) + CONTEXT_CREATE)
write("compute_wire", "nested_65535", nested(65535, [SYNC_CTX1]) + CONTEXT_CREATE)
write("compute_wire", "nested_lying_count", nested(3000, [SYNC_CTX1, SYNC_CTX1], at=1, lie=2) + CONTEXT_CREATE)
write("compute_wire", "batch_one_level", nested(0, [SYNC_CTX1, SYNC_CTX1, SYNC_CTX1]) + CONTEXT_CREATE)
