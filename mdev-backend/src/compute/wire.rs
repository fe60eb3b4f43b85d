//! The compute remoting protocol: what a guest's `libcuda.so.1` sends (over the private
//! virtio-gpu context, or a socket on the host) and what the host answers. Pure decoding and
//! encoding (a reply also read from or written to a stream whole, [`Reply::read_from`] and
//! [`Reply::write_to`]): [`Request::decode`] validates every length against its limit before
//! allocating, and a decode failure is an error, never a panic.
//!
//! A message is `u32` length (of what follows), `u16` opcode, then the fields, little-endian;
//! byte strings are a `u32` length and the bytes.

use std::io::{Read, Write};

use thiserror::Error;

use super::backend::{
    ContextId, DeviceAttributes, EventId, FunctionAttributes, FunctionId, ModuleId, ParamInfo,
    StreamId,
};
use super::{ComputeError, ptx};

/// Largest message: a module image of [`ptx::MAX_PTX_BYTES`] plus its framing.
pub const MAX_MESSAGE_BYTES: usize = ptx::MAX_PTX_BYTES + 4096;
/// Largest copy in one message; the guest library splits bigger copies.
pub const MAX_COPY_BYTES: u64 = 8 << 20;
/// Images in one link request.
pub const MAX_LINK_IMAGES: usize = ptx::MAX_LINKED_IMAGES;
/// Longest kernel or variable name.
pub const MAX_NAME_BYTES: usize = 4096;
/// Parameters of one kernel in a reply.
pub const MAX_PARAMS: usize = 4096;
/// Longest error message or printf output carried.
pub const MAX_TEXT_BYTES: usize = 2 << 20;
/// Requests in one [`Request::Batch`].
pub const MAX_BATCH: usize = 1024;
/// Opcode of [`Request::Batch`].
const BATCH_OPCODE: u16 = 29;
/// Opcodes of the requests a [`Request::Batch`] may hold, those whose reply carries nothing
/// but success or an error: `ContextSynchronize` (4), `MemsetD8` (12), `MemsetD32` (13),
/// `CopyHtoD` (14), `CopyDtoD` (16), `StreamSynchronize` (19), `EventRecord` (23),
/// `EventSynchronize` (24) and `Launch` (27). A batched request is checked against it from
/// its opcode, before it is decoded, so a batch never holds a batch and decoding recurses at
/// most one level.
const BATCHABLE_OPCODES: [u16; 9] = [4, 12, 13, 14, 16, 19, 23, 24, 27];

/// Why bytes are not a valid message.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WireError {
    #[error("message truncated")]
    Truncated,
    #[error("{0} trailing bytes")]
    Trailing(usize),
    #[error("unknown opcode {0}")]
    Opcode(u16),
    #[error("{what} of {len} bytes is past its limit of {max}")]
    TooLong {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("text is not UTF-8")]
    Utf8,
    #[error("request {0} cannot be batched")]
    NotBatchable(u16),
}

/// A call of the guest's driver.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    Attributes,
    ContextCreate,
    /// A context whose device addresses lie in `[base, base + size)`, a range the guest
    /// library reserved in its process (unified addressing).
    ContextCreateAt {
        base: u64,
        size: u64,
    },
    ContextDestroy {
        ctx: ContextId,
    },
    ContextSynchronize {
        ctx: ContextId,
    },
    ModuleLoad {
        ctx: ContextId,
        image: Vec<u8>,
    },
    ModuleLink {
        ctx: ContextId,
        images: Vec<Vec<u8>>,
    },
    ModuleUnload {
        ctx: ContextId,
        module: ModuleId,
    },
    Function {
        ctx: ContextId,
        module: ModuleId,
        name: String,
    },
    Global {
        ctx: ContextId,
        module: ModuleId,
        name: String,
    },
    MemAlloc {
        ctx: ContextId,
        bytes: u64,
    },
    MemFree {
        ctx: ContextId,
        addr: u64,
    },
    MemsetD8 {
        ctx: ContextId,
        addr: u64,
        value: u8,
        count: u64,
        stream: StreamId,
    },
    MemsetD32 {
        ctx: ContextId,
        addr: u64,
        value: u32,
        count: u64,
        stream: StreamId,
    },
    CopyHtoD {
        ctx: ContextId,
        dst: u64,
        data: Vec<u8>,
        stream: StreamId,
    },
    CopyDtoH {
        ctx: ContextId,
        src: u64,
        bytes: u64,
        stream: StreamId,
    },
    CopyDtoD {
        ctx: ContextId,
        dst: u64,
        src: u64,
        bytes: u64,
        stream: StreamId,
    },
    StreamCreate {
        ctx: ContextId,
    },
    StreamDestroy {
        ctx: ContextId,
        stream: StreamId,
    },
    StreamSynchronize {
        ctx: ContextId,
        stream: StreamId,
    },
    StreamQuery {
        ctx: ContextId,
        stream: StreamId,
    },
    EventCreate {
        ctx: ContextId,
    },
    EventDestroy {
        ctx: ContextId,
        event: EventId,
    },
    EventRecord {
        ctx: ContextId,
        event: EventId,
        stream: StreamId,
    },
    EventSynchronize {
        ctx: ContextId,
        event: EventId,
    },
    EventQuery {
        ctx: ContextId,
        event: EventId,
    },
    EventElapsed {
        ctx: ContextId,
        start: EventId,
        end: EventId,
    },
    Launch {
        ctx: ContextId,
        function: FunctionId,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        stream: StreamId,
        params: Vec<u8>,
        /// `cuLaunchCooperativeKernel`: every block resident at once (see
        /// [`KernelLaunch::cooperative`](super::backend::KernelLaunch::cooperative)).
        cooperative: bool,
    },
    TakeOutput {
        ctx: ContextId,
    },
    FunctionAttributes {
        ctx: ContextId,
        function: FunctionId,
    },
    /// `cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE)`: the size of the context's device heap.
    SetHeapSize {
        ctx: ContextId,
        bytes: u64,
    },
    /// `cuMemGetInfo`: the device memory the context could still allocate, and its total.
    MemInfo {
        ctx: ContextId,
    },
    /// The device time the VM's work has taken (what a guest's `vgpu-smi` turns into its
    /// utilisation): no context, as the figure is the VM's, not one program's.
    Usage,
    /// Asynchronous work the guest deferred to its next synchronisation point, run in order
    /// up to the first failure: only requests whose reply carries nothing but success or an
    /// error (launches, host-to-device and device-to-device copies, memsets, event records, and
    /// the synchronisation that ends the batch). A decoded batch never holds a batch (the
    /// decoder refuses one from its opcode), so what walks a decoded request (`work`, the
    /// backends' execution, `encode`) recurses at most one level.
    Batch(Vec<Request>),
}

/// The device work a request makes: what a scheduler's cost signature is made of.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Work {
    /// Kernel launches.
    pub launches: u64,
    /// Threads over all launches (grid × block), saturating.
    pub threads: u64,
    /// Bytes copied or set on the device, saturating.
    pub bytes: u64,
}

impl Work {
    /// Whether the request makes device work (a command group) rather than control work.
    pub fn any(&self) -> bool {
        self.launches > 0 || self.bytes > 0
    }
}

impl Request {
    /// Whether the request holds the device while it runs: device work, or a wait for it
    /// (what [`Request::Usage`] counts as the VM's device time).
    pub fn occupies_device(&self) -> bool {
        self.work().any()
            || matches!(
                self,
                Request::ContextSynchronize { .. }
                    | Request::StreamSynchronize { .. }
                    | Request::EventSynchronize { .. }
            )
    }

    /// The device work of this request (a batch: of all it holds).
    pub fn work(&self) -> Work {
        let product = |v: [u32; 3]| v.iter().fold(1u64, |p, &d| p.saturating_mul(u64::from(d)));
        let bytes = |n: u64| Work {
            bytes: n,
            ..Work::default()
        };
        match self {
            Request::Launch { grid, block, .. } => Work {
                launches: 1,
                threads: product(*grid).saturating_mul(product(*block)),
                bytes: 0,
            },
            Request::CopyHtoD { data, .. } => bytes(data.len() as u64),
            Request::CopyDtoH { bytes: n, .. } | Request::CopyDtoD { bytes: n, .. } => bytes(*n),
            Request::MemsetD8 { count, .. } => bytes(*count),
            Request::MemsetD32 { count, .. } => bytes(count.saturating_mul(4)),
            Request::Batch(items) => {
                items
                    .iter()
                    .map(Request::work)
                    .fold(Work::default(), |a, w| Work {
                        launches: a.launches.saturating_add(w.launches),
                        threads: a.threads.saturating_add(w.threads),
                        bytes: a.bytes.saturating_add(w.bytes),
                    })
            }
            _ => Work::default(),
        }
    }
}

/// The host's answer to one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Done,
    /// A new context, module, stream or event handle.
    Id(u32),
    /// A device address (allocation).
    Address(u64),
    Function {
        id: FunctionId,
        params: Vec<ParamInfo>,
    },
    Global {
        addr: u64,
        size: u64,
    },
    Data(Vec<u8>),
    Elapsed(f32),
    Attributes(DeviceAttributes),
    /// Device printf output: the reply to `TakeOutput`, and to a successful `Launch` (what
    /// the launch printed).
    Output(String),
    /// The call failed: its `CUresult` and why.
    Error {
        status: u32,
        message: String,
    },
    /// How a [`Request::Batch`] went: the requests that succeeded, in order, the printf output
    /// of its launches, and the first failure (after which nothing ran).
    Batch {
        completed: u32,
        output: String,
        error: Option<(u32, String)>,
    },
    FunctionAttributes(FunctionAttributes),
    /// The reply to [`Request::MemInfo`]: bytes the context could allocate now (within its
    /// own limit and its VM's budget), and the total it reports (`cuDeviceTotalMem`).
    MemInfo {
        free: u64,
        total: u64,
    },
    /// The reply to [`Request::Usage`]: nanoseconds the VM's device work (kernels, copies,
    /// memsets, synchronisations) has run, and nanoseconds elapsed, both since one origin
    /// (the connection's start on the host path, the VM's compute start on the device). Two
    /// samples give the utilisation over the time between them: `Δbusy / Δelapsed`.
    Usage {
        busy_ns: u64,
        elapsed_ns: u64,
    },
}

impl Reply {
    /// The reply for a failed call.
    pub fn error(e: &ComputeError) -> Reply {
        let mut message = e.to_string();
        truncate(&mut message, MAX_TEXT_BYTES);
        Reply::Error {
            status: e.cuda_status(),
            message,
        }
    }
}

/// Cuts `s` to at most `max` bytes at a character boundary.
pub fn truncate(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

/// Message writer.
struct Out(Vec<u8>);

impl Out {
    fn new(op: u16) -> Out {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&[0; 4]);
        v.extend_from_slice(&op.to_le_bytes());
        Out(v)
    }
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.0.extend_from_slice(b);
        self
    }
    fn dims(&mut self, d: [u32; 3]) -> &mut Self {
        d.iter().for_each(|&v| {
            self.u32(v);
        });
        self
    }
    fn finish(mut self) -> Vec<u8> {
        let len = u32::try_from(self.0.len() - 4).unwrap_or(u32::MAX);
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

/// Message reader over one message's body (after the length).
struct In<'a>(&'a [u8]);

impl<'a> In<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Truncated);
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn bytes(&mut self, what: &'static str, max: usize) -> Result<&'a [u8], WireError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(WireError::TooLong { what, len, max });
        }
        self.take(len)
    }
    fn text(&mut self, what: &'static str, max: usize) -> Result<String, WireError> {
        let b = self.bytes(what, max)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::Utf8)
    }
    fn dims(&mut self) -> Result<[u32; 3], WireError> {
        Ok([self.u32()?, self.u32()?, self.u32()?])
    }
    fn ctx(&mut self) -> Result<ContextId, WireError> {
        self.u32().map(ContextId)
    }
    fn module(&mut self) -> Result<ModuleId, WireError> {
        self.u32().map(ModuleId)
    }
    fn stream(&mut self) -> Result<StreamId, WireError> {
        self.u32().map(StreamId)
    }
    fn event(&mut self) -> Result<EventId, WireError> {
        self.u32().map(EventId)
    }
    fn end(&self) -> Result<(), WireError> {
        match self.0.len() {
            0 => Ok(()),
            n => Err(WireError::Trailing(n)),
        }
    }
}

/// The body length a message's 4-byte header announces, checked against
/// [`MAX_MESSAGE_BYTES`]: what a transport reads next.
pub fn body_len(header: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_MESSAGE_BYTES {
        return Err(WireError::TooLong {
            what: "message",
            len,
            max: MAX_MESSAGE_BYTES,
        });
    }
    Ok(len)
}

/// Kind of a [`Reply::Data`] message.
const DATA_REPLY: u16 = 6;
/// A data reply's body before its payload: kind and payload length.
const DATA_REPLY_HEAD: usize = 2 + 4;

impl Request {
    /// The whole message: length, opcode, fields.
    pub fn encode(&self) -> Vec<u8> {
        use Request::*;
        let mut o;
        match self {
            Attributes => o = Out::new(1),
            ContextCreate => o = Out::new(2),
            ContextDestroy { ctx } => {
                o = Out::new(3);
                o.u32(ctx.0);
            }
            ContextSynchronize { ctx } => {
                o = Out::new(4);
                o.u32(ctx.0);
            }
            ModuleLoad { ctx, image } => {
                o = Out::new(5);
                o.u32(ctx.0).bytes(image);
            }
            ModuleLink { ctx, images } => {
                o = Out::new(6);
                o.u32(ctx.0)
                    .u32(u32::try_from(images.len()).unwrap_or(u32::MAX));
                images.iter().for_each(|i| {
                    o.bytes(i);
                });
            }
            ModuleUnload { ctx, module } => {
                o = Out::new(7);
                o.u32(ctx.0).u32(module.0);
            }
            Function { ctx, module, name } => {
                o = Out::new(8);
                o.u32(ctx.0).u32(module.0).bytes(name.as_bytes());
            }
            Global { ctx, module, name } => {
                o = Out::new(9);
                o.u32(ctx.0).u32(module.0).bytes(name.as_bytes());
            }
            MemAlloc { ctx, bytes } => {
                o = Out::new(10);
                o.u32(ctx.0).u64(*bytes);
            }
            MemFree { ctx, addr } => {
                o = Out::new(11);
                o.u32(ctx.0).u64(*addr);
            }
            MemsetD8 {
                ctx,
                addr,
                value,
                count,
                stream,
            } => {
                o = Out::new(12);
                o.u32(ctx.0).u64(*addr).u8(*value).u64(*count).u32(stream.0);
            }
            MemsetD32 {
                ctx,
                addr,
                value,
                count,
                stream,
            } => {
                o = Out::new(13);
                o.u32(ctx.0)
                    .u64(*addr)
                    .u32(*value)
                    .u64(*count)
                    .u32(stream.0);
            }
            CopyHtoD {
                ctx,
                dst,
                data,
                stream,
            } => {
                o = Out::new(14);
                o.u32(ctx.0).u64(*dst).bytes(data).u32(stream.0);
            }
            CopyDtoH {
                ctx,
                src,
                bytes,
                stream,
            } => {
                o = Out::new(15);
                o.u32(ctx.0).u64(*src).u64(*bytes).u32(stream.0);
            }
            CopyDtoD {
                ctx,
                dst,
                src,
                bytes,
                stream,
            } => {
                o = Out::new(16);
                o.u32(ctx.0).u64(*dst).u64(*src).u64(*bytes).u32(stream.0);
            }
            StreamCreate { ctx } => {
                o = Out::new(17);
                o.u32(ctx.0);
            }
            StreamDestroy { ctx, stream } => {
                o = Out::new(18);
                o.u32(ctx.0).u32(stream.0);
            }
            StreamSynchronize { ctx, stream } => {
                o = Out::new(19);
                o.u32(ctx.0).u32(stream.0);
            }
            StreamQuery { ctx, stream } => {
                o = Out::new(20);
                o.u32(ctx.0).u32(stream.0);
            }
            EventCreate { ctx } => {
                o = Out::new(21);
                o.u32(ctx.0);
            }
            EventDestroy { ctx, event } => {
                o = Out::new(22);
                o.u32(ctx.0).u32(event.0);
            }
            EventRecord { ctx, event, stream } => {
                o = Out::new(23);
                o.u32(ctx.0).u32(event.0).u32(stream.0);
            }
            EventSynchronize { ctx, event } => {
                o = Out::new(24);
                o.u32(ctx.0).u32(event.0);
            }
            EventQuery { ctx, event } => {
                o = Out::new(25);
                o.u32(ctx.0).u32(event.0);
            }
            EventElapsed { ctx, start, end } => {
                o = Out::new(26);
                o.u32(ctx.0).u32(start.0).u32(end.0);
            }
            Launch {
                ctx,
                function,
                grid,
                block,
                shared_bytes,
                stream,
                params,
                cooperative,
            } => {
                o = Out::new(27);
                o.u32(ctx.0)
                    .u32(function.0)
                    .dims(*grid)
                    .dims(*block)
                    .u32(*shared_bytes)
                    .u32(stream.0)
                    .u8(u8::from(*cooperative))
                    .bytes(params);
            }
            TakeOutput { ctx } => {
                o = Out::new(28);
                o.u32(ctx.0);
            }
            FunctionAttributes { ctx, function } => {
                o = Out::new(30);
                o.u32(ctx.0).u32(function.0);
            }
            ContextCreateAt { base, size } => {
                o = Out::new(31);
                o.u64(*base).u64(*size);
            }
            SetHeapSize { ctx, bytes } => {
                o = Out::new(32);
                o.u32(ctx.0).u64(*bytes);
            }
            MemInfo { ctx } => {
                o = Out::new(33);
                o.u32(ctx.0);
            }
            Usage => o = Out::new(34),
            Batch(requests) => {
                o = Out::new(BATCH_OPCODE);
                o.u32(u32::try_from(requests.len()).unwrap_or(u32::MAX));
                for r in requests {
                    o.bytes(&r.encode()[4..]);
                }
            }
        }
        o.finish()
    }

    /// Decodes one message body (what follows the length).
    pub fn decode(body: &[u8]) -> Result<Request, WireError> {
        use Request::*;
        let mut i = In(body);
        let r = match i.u16()? {
            1 => Attributes,
            2 => ContextCreate,
            3 => ContextDestroy { ctx: i.ctx()? },
            4 => ContextSynchronize { ctx: i.ctx()? },
            5 => ModuleLoad {
                ctx: i.ctx()?,
                image: i.bytes("module image", ptx::MAX_PTX_BYTES)?.to_vec(),
            },
            6 => {
                let ctx = i.ctx()?;
                let n = i.u32()? as usize;
                if n > MAX_LINK_IMAGES {
                    return Err(WireError::TooLong {
                        what: "link",
                        len: n,
                        max: MAX_LINK_IMAGES,
                    });
                }
                let mut images = Vec::new();
                for _ in 0..n {
                    images.push(i.bytes("module image", ptx::MAX_PTX_BYTES)?.to_vec());
                }
                ModuleLink { ctx, images }
            }
            7 => ModuleUnload {
                ctx: i.ctx()?,
                module: i.module()?,
            },
            8 => Function {
                ctx: i.ctx()?,
                module: i.module()?,
                name: i.text("name", MAX_NAME_BYTES)?,
            },
            9 => Global {
                ctx: i.ctx()?,
                module: i.module()?,
                name: i.text("name", MAX_NAME_BYTES)?,
            },
            10 => MemAlloc {
                ctx: i.ctx()?,
                bytes: i.u64()?,
            },
            11 => MemFree {
                ctx: i.ctx()?,
                addr: i.u64()?,
            },
            12 => MemsetD8 {
                ctx: i.ctx()?,
                addr: i.u64()?,
                value: i.u8()?,
                count: i.u64()?,
                stream: i.stream()?,
            },
            13 => MemsetD32 {
                ctx: i.ctx()?,
                addr: i.u64()?,
                value: i.u32()?,
                count: i.u64()?,
                stream: i.stream()?,
            },
            14 => CopyHtoD {
                ctx: i.ctx()?,
                dst: i.u64()?,
                data: i.bytes("copy", MAX_COPY_BYTES as usize)?.to_vec(),
                stream: i.stream()?,
            },
            15 => {
                let (ctx, src, bytes, stream) = (i.ctx()?, i.u64()?, i.u64()?, i.stream()?);
                if bytes > MAX_COPY_BYTES {
                    return Err(WireError::TooLong {
                        what: "copy",
                        len: usize::try_from(bytes).unwrap_or(usize::MAX),
                        max: MAX_COPY_BYTES as usize,
                    });
                }
                CopyDtoH {
                    ctx,
                    src,
                    bytes,
                    stream,
                }
            }
            16 => CopyDtoD {
                ctx: i.ctx()?,
                dst: i.u64()?,
                src: i.u64()?,
                bytes: i.u64()?,
                stream: i.stream()?,
            },
            17 => StreamCreate { ctx: i.ctx()? },
            18 => StreamDestroy {
                ctx: i.ctx()?,
                stream: i.stream()?,
            },
            19 => StreamSynchronize {
                ctx: i.ctx()?,
                stream: i.stream()?,
            },
            20 => StreamQuery {
                ctx: i.ctx()?,
                stream: i.stream()?,
            },
            21 => EventCreate { ctx: i.ctx()? },
            22 => EventDestroy {
                ctx: i.ctx()?,
                event: i.event()?,
            },
            23 => EventRecord {
                ctx: i.ctx()?,
                event: i.event()?,
                stream: i.stream()?,
            },
            24 => EventSynchronize {
                ctx: i.ctx()?,
                event: i.event()?,
            },
            25 => EventQuery {
                ctx: i.ctx()?,
                event: i.event()?,
            },
            26 => EventElapsed {
                ctx: i.ctx()?,
                start: i.event()?,
                end: i.event()?,
            },
            27 => Launch {
                ctx: i.ctx()?,
                function: FunctionId(i.u32()?),
                grid: i.dims()?,
                block: i.dims()?,
                shared_bytes: i.u32()?,
                stream: i.stream()?,
                cooperative: i.u8()? != 0,
                params: i
                    .bytes("parameters", ptx::MAX_PARAM_BYTES as usize)?
                    .to_vec(),
            },
            28 => TakeOutput { ctx: i.ctx()? },
            30 => FunctionAttributes {
                ctx: i.ctx()?,
                function: FunctionId(i.u32()?),
            },
            31 => ContextCreateAt {
                base: i.u64()?,
                size: i.u64()?,
            },
            32 => SetHeapSize {
                ctx: i.ctx()?,
                bytes: i.u64()?,
            },
            33 => MemInfo { ctx: i.ctx()? },
            34 => Usage,
            BATCH_OPCODE => {
                let n = i.u32()? as usize;
                if n > MAX_BATCH {
                    return Err(WireError::TooLong {
                        what: "batch",
                        len: n,
                        max: MAX_BATCH,
                    });
                }
                let mut requests = Vec::new();
                for _ in 0..n {
                    let body = i.bytes("batched request", MAX_MESSAGE_BYTES)?;
                    let op = In(body).u16()?;
                    // Refused from its opcode before it is decoded: 20,000 batches nested
                    // in a 200 KB message, each decoded before it was checked, overflowed
                    // the decoding thread's stack.
                    if !BATCHABLE_OPCODES.contains(&op) {
                        return Err(WireError::NotBatchable(op));
                    }
                    let r = Request::decode(body)?;
                    requests.push(r);
                }
                Batch(requests)
            }
            op => return Err(WireError::Opcode(op)),
        };
        i.end()?;
        Ok(r)
    }
}

impl Reply {
    /// The whole message: length, kind, fields.
    pub fn encode(&self) -> Vec<u8> {
        let mut o;
        match self {
            Reply::Done => o = Out::new(1),
            Reply::Id(id) => {
                o = Out::new(2);
                o.u32(*id);
            }
            Reply::Address(a) => {
                o = Out::new(3);
                o.u64(*a);
            }
            Reply::Function { id, params } => {
                o = Out::new(4);
                o.u32(id.0)
                    .u32(u32::try_from(params.len()).unwrap_or(u32::MAX));
                params.iter().for_each(|p| {
                    o.u32(p.offset).u32(p.size).u32(p.align);
                });
            }
            Reply::Global { addr, size } => {
                o = Out::new(5);
                o.u64(*addr).u64(*size);
            }
            Reply::Data(d) => {
                o = Out::new(DATA_REPLY);
                o.bytes(d);
            }
            Reply::Elapsed(ms) => {
                o = Out::new(7);
                o.u32(ms.to_bits());
            }
            Reply::Attributes(a) => {
                o = Out::new(8);
                o.bytes(a.name.as_bytes())
                    .u64(a.total_memory)
                    .u32(a.compute_capability.0)
                    .u32(a.compute_capability.1)
                    .u32(a.multiprocessors)
                    .u32(a.max_threads_per_block)
                    .dims(a.max_block)
                    .dims(a.max_grid)
                    .u32(a.shared_memory_per_block)
                    .u32(a.warp_size)
                    .u32(a.clock_khz)
                    .u8(u8::from(a.placement));
            }
            Reply::Output(s) => {
                o = Out::new(9);
                o.bytes(s.as_bytes());
            }
            Reply::Error { status, message } => {
                o = Out::new(10);
                o.u32(*status).bytes(message.as_bytes());
            }
            Reply::Batch {
                completed,
                output,
                error,
            } => {
                o = Out::new(11);
                o.u32(*completed).bytes(output.as_bytes());
                match error {
                    Some((status, message)) => o.u8(1).u32(*status).bytes(message.as_bytes()),
                    None => o.u8(0),
                };
            }
            Reply::FunctionAttributes(a) => {
                o = Out::new(12);
                o.u32(a.max_threads_per_block)
                    .u32(a.shared_size_bytes)
                    .u32(a.const_size_bytes)
                    .u32(a.local_size_bytes)
                    .u32(a.num_regs);
            }
            Reply::MemInfo { free, total } => {
                o = Out::new(13);
                o.u64(*free).u64(*total);
            }
            Reply::Usage {
                busy_ns,
                elapsed_ns,
            } => {
                o = Out::new(14);
                o.u64(*busy_ns).u64(*elapsed_ns);
            }
        }
        o.finish()
    }

    /// Writes the message [`Reply::encode`] makes to `w`; a data reply's payload goes from its
    /// own buffer, not copied into a message first.
    pub fn write_to(&self, w: &mut impl Write) -> std::io::Result<()> {
        let Reply::Data(d) = self else {
            return w.write_all(&self.encode());
        };
        let mut head = Out::new(DATA_REPLY);
        head.u32(u32::try_from(d.len()).unwrap_or(u32::MAX));
        let len = (head.0.len() - 4)
            .checked_add(d.len())
            .and_then(|l| u32::try_from(l).ok())
            .unwrap_or(u32::MAX);
        head.0[..4].copy_from_slice(&len.to_le_bytes());
        w.write_all(&head.0)?;
        w.write_all(d)
    }

    /// Reads one whole reply message from `r` with the checks of [`body_len`] and
    /// [`Reply::decode`]: the outer error is the stream's, the inner the message's (read whole
    /// either way, so the stream stays at a message boundary). A well-formed data reply's
    /// payload is read straight into its buffer, not copied out of the message.
    pub fn read_from(r: &mut impl Read) -> std::io::Result<Result<Reply, WireError>> {
        let mut header = [0u8; 4];
        r.read_exact(&mut header)?;
        let len = match body_len(header) {
            Ok(len) => len,
            Err(e) => return Ok(Err(e)),
        };
        let mut head = [0u8; DATA_REPLY_HEAD];
        let head = &mut head[..len.min(DATA_REPLY_HEAD)];
        r.read_exact(head)?;
        if let [k0, k1, n0, n1, n2, n3] = *head {
            let n = u32::from_le_bytes([n0, n1, n2, n3]) as usize;
            if u16::from_le_bytes([k0, k1]) == DATA_REPLY
                && n <= MAX_COPY_BYTES as usize
                && Some(len) == n.checked_add(DATA_REPLY_HEAD)
            {
                let mut data = vec![0u8; n];
                r.read_exact(&mut data)?;
                return Ok(Ok(Reply::Data(data)));
            }
        }
        let mut body = vec![0u8; len];
        body[..head.len()].copy_from_slice(head);
        r.read_exact(&mut body[head.len()..])?;
        Ok(Reply::decode(&body))
    }

    /// Decodes one reply body (what follows the length).
    pub fn decode(body: &[u8]) -> Result<Reply, WireError> {
        let mut i = In(body);
        let r = match i.u16()? {
            1 => Reply::Done,
            2 => Reply::Id(i.u32()?),
            3 => Reply::Address(i.u64()?),
            4 => {
                let id = FunctionId(i.u32()?);
                let n = i.u32()? as usize;
                if n > MAX_PARAMS {
                    return Err(WireError::TooLong {
                        what: "parameter list",
                        len: n,
                        max: MAX_PARAMS,
                    });
                }
                let mut params = Vec::with_capacity(n);
                for _ in 0..n {
                    params.push(ParamInfo {
                        offset: i.u32()?,
                        size: i.u32()?,
                        align: i.u32()?,
                    });
                }
                Reply::Function { id, params }
            }
            5 => Reply::Global {
                addr: i.u64()?,
                size: i.u64()?,
            },
            DATA_REPLY => Reply::Data(i.bytes("data", MAX_COPY_BYTES as usize)?.to_vec()),
            7 => Reply::Elapsed(f32::from_bits(i.u32()?)),
            8 => Reply::Attributes(DeviceAttributes {
                name: i.text("device name", MAX_NAME_BYTES)?,
                total_memory: i.u64()?,
                compute_capability: (i.u32()?, i.u32()?),
                multiprocessors: i.u32()?,
                max_threads_per_block: i.u32()?,
                max_block: i.dims()?,
                max_grid: i.dims()?,
                shared_memory_per_block: i.u32()?,
                warp_size: i.u32()?,
                clock_khz: i.u32()?,
                placement: i.u8()? != 0,
            }),
            9 => Reply::Output(i.text("output", MAX_TEXT_BYTES)?),
            10 => Reply::Error {
                status: i.u32()?,
                message: i.text("message", MAX_TEXT_BYTES)?,
            },
            11 => Reply::Batch {
                completed: i.u32()?,
                output: i.text("output", MAX_TEXT_BYTES)?,
                error: match i.u8()? {
                    0 => None,
                    _ => Some((i.u32()?, i.text("message", MAX_TEXT_BYTES)?)),
                },
            },
            12 => Reply::FunctionAttributes(FunctionAttributes {
                max_threads_per_block: i.u32()?,
                shared_size_bytes: i.u32()?,
                const_size_bytes: i.u32()?,
                local_size_bytes: i.u32()?,
                num_regs: i.u32()?,
            }),
            13 => Reply::MemInfo {
                free: i.u64()?,
                total: i.u64()?,
            },
            14 => Reply::Usage {
                busy_ns: i.u64()?,
                elapsed_ns: i.u64()?,
            },
            op => return Err(WireError::Opcode(op)),
        };
        i.end()?;
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_request() -> Vec<Request> {
        use Request::*;
        let (ctx, module, stream, event) = (ContextId(3), ModuleId(4), StreamId(5), EventId(6));
        vec![
            Attributes,
            ContextCreate,
            ContextDestroy { ctx },
            ContextSynchronize { ctx },
            ModuleLoad {
                ctx,
                image: b".version 8.5".to_vec(),
            },
            ModuleLink {
                ctx,
                images: vec![b"a".to_vec(), vec![], b"ccc".to_vec()],
            },
            ModuleUnload { ctx, module },
            Function {
                ctx,
                module,
                name: "main$_omp_fn$0".into(),
            },
            Global {
                ctx,
                module,
                name: "__nvptx_clocktick".into(),
            },
            MemAlloc {
                ctx,
                bytes: 1 << 40,
            },
            MemFree { ctx, addr: 7 },
            MemsetD8 {
                ctx,
                addr: 8,
                value: 0xa5,
                count: 9,
                stream,
            },
            MemsetD32 {
                ctx,
                addr: 8,
                value: 0xdead_beef,
                count: 9,
                stream,
            },
            CopyHtoD {
                ctx,
                dst: 10,
                data: vec![1, 2, 3],
                stream,
            },
            CopyDtoH {
                ctx,
                src: 11,
                bytes: 12,
                stream,
            },
            CopyDtoD {
                ctx,
                dst: 13,
                src: 14,
                bytes: 15,
                stream,
            },
            StreamCreate { ctx },
            StreamDestroy { ctx, stream },
            StreamSynchronize { ctx, stream },
            StreamQuery { ctx, stream },
            EventCreate { ctx },
            EventDestroy { ctx, event },
            EventRecord { ctx, event, stream },
            EventSynchronize { ctx, event },
            EventQuery { ctx, event },
            EventElapsed {
                ctx,
                start: event,
                end: EventId(7),
            },
            Launch {
                ctx,
                function: FunctionId(8),
                grid: [1, 2, 3],
                block: [4, 5, 6],
                shared_bytes: 7,
                stream,
                params: vec![9; 24],
                cooperative: true,
            },
            TakeOutput { ctx },
            FunctionAttributes {
                ctx,
                function: FunctionId(8),
            },
            ContextCreateAt {
                base: 1 << 40,
                size: 1 << 30,
            },
            SetHeapSize {
                ctx,
                bytes: 128 << 20,
            },
            MemInfo { ctx },
            Usage,
            Batch(vec![
                MemsetD8 {
                    ctx,
                    addr: 1,
                    value: 2,
                    count: 3,
                    stream,
                },
                CopyHtoD {
                    ctx,
                    dst: 1,
                    data: vec![7; 3],
                    stream,
                },
            ]),
        ]
    }

    fn body(msg: &[u8]) -> &[u8] {
        let len = body_len(msg[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, msg.len() - 4);
        &msg[4..]
    }

    #[test]
    fn work_counts_launches_threads_and_device_bytes_of_a_request_or_batch() {
        let launch = Request::Launch {
            ctx: ContextId(1),
            function: FunctionId(2),
            grid: [4, 2, 1],
            block: [128, 1, 1],
            shared_bytes: 0,
            stream: StreamId(0),
            params: vec![],
            cooperative: false,
        };
        let copy = Request::CopyHtoD {
            ctx: ContextId(1),
            dst: 0,
            data: vec![0; 100],
            stream: StreamId(0),
        };
        let memset = Request::MemsetD32 {
            ctx: ContextId(1),
            addr: 0,
            value: 0,
            count: 10,
            stream: StreamId(0),
        };
        assert_eq!(
            Request::Batch(vec![launch.clone(), copy, memset, launch]).work(),
            Work {
                launches: 2,
                threads: 2048,
                bytes: 140
            }
        );
        let control = Request::MemAlloc {
            ctx: ContextId(1),
            bytes: 1 << 30,
        };
        assert!(!control.work().any());
        let huge = Request::Launch {
            ctx: ContextId(1),
            function: FunctionId(2),
            grid: [u32::MAX; 3],
            block: [u32::MAX; 3],
            shared_bytes: 0,
            stream: StreamId(0),
            params: vec![],
            cooperative: false,
        };
        assert_eq!(huge.work().threads, u64::MAX, "saturates");
    }

    #[test]
    fn every_request_and_reply_round_trips() {
        for r in every_request() {
            assert_eq!(Request::decode(body(&r.encode())).unwrap(), r);
        }
        let replies = [
            Reply::Done,
            Reply::Id(3),
            Reply::Address(0x7f00_0000_0000),
            Reply::Function {
                id: FunctionId(2),
                params: vec![ParamInfo {
                    offset: 8,
                    size: 8,
                    align: 8,
                }],
            },
            Reply::Global { addr: 1, size: 2 },
            Reply::Data(vec![1, 2, 3]),
            Reply::Elapsed(1.5),
            Reply::Attributes(crate::compute::ComputeBackend::attributes(
                &crate::compute::CpuBackend::new(Default::default()),
            )),
            Reply::Output("hello\n".into()),
            Reply::error(&ComputeError::IllegalAddress("x".into())),
            Reply::Batch {
                completed: 3,
                output: "hi\n".into(),
                error: Some((700, "illegal address".into())),
            },
            Reply::Batch {
                completed: 0,
                output: String::new(),
                error: None,
            },
            Reply::FunctionAttributes(crate::compute::backend::FunctionAttributes {
                max_threads_per_block: 1024,
                shared_size_bytes: 2,
                const_size_bytes: 3,
                local_size_bytes: 4,
                num_regs: 80,
            }),
            Reply::MemInfo {
                free: 3 << 20,
                total: 1 << 30,
            },
            Reply::Usage {
                busy_ns: 7 << 30,
                elapsed_ns: u64::MAX,
            },
        ];
        for r in replies {
            assert_eq!(Reply::decode(body(&r.encode())).unwrap(), r);
        }
    }

    #[test]
    fn replies_written_and_read_over_a_stream_are_their_messages() {
        let replies = [
            Reply::Data(vec![7; 1000]),
            Reply::Data(vec![]),
            Reply::Done,
            Reply::Id(3),
            Reply::Output("hi\n".into()),
        ];
        let mut stream = Vec::new();
        for r in &replies {
            let mut one = Vec::new();
            r.write_to(&mut one).unwrap();
            assert_eq!(one, r.encode(), "{r:?}");
            stream.extend_from_slice(&one);
        }
        let mut rd = &stream[..];
        for r in &replies {
            assert_eq!(&Reply::read_from(&mut rd).unwrap().unwrap(), r);
        }
        assert!(rd.is_empty());
        assert!(Reply::read_from(&mut rd).is_err(), "the stream's end");
    }

    #[test]
    fn a_bad_data_reply_read_from_a_stream_is_decode_s_error_and_read_whole() {
        let data = |len: u32, n: u32, payload: usize| {
            let mut m = len.to_le_bytes().to_vec();
            m.extend_from_slice(&DATA_REPLY.to_le_bytes());
            m.extend_from_slice(&n.to_le_bytes());
            m.extend(std::iter::repeat_n(1u8, payload));
            m
        };
        let max = MAX_COPY_BYTES as u32;
        let bad = [
            // Payload past the limit, claimed and sent.
            data(6 + max + 1, max + 1, max as usize + 1),
            // Shorter than it says, longer than it says, shorter than a data reply's head.
            data(6 + 2, 4, 2),
            data(6 + 4, 2, 4),
            vec![3, 0, 0, 0, 6, 0, 0],
        ];
        for m in bad {
            let body = &m[4..];
            let expected = Reply::decode(body).unwrap_err();
            let mut stream = m.clone();
            Reply::Done.write_to(&mut stream).unwrap();
            let mut rd = &stream[..];
            assert_eq!(
                Reply::read_from(&mut rd).unwrap().unwrap_err().to_string(),
                expected.to_string()
            );
            assert_eq!(Reply::read_from(&mut rd).unwrap().unwrap(), Reply::Done);
        }
        // A length past a message's limit is refused before anything is read.
        let mut rd = &((MAX_MESSAGE_BYTES as u32) + 1).to_le_bytes()[..];
        assert!(matches!(
            Reply::read_from(&mut rd).unwrap(),
            Err(WireError::TooLong { .. })
        ));
    }

    #[test]
    fn a_usage_request_or_reply_cut_short_or_padded_is_refused() {
        let req = Request::Usage.encode();
        assert_eq!(req, [2, 0, 0, 0, 34, 0], "no fields: the VM's figure");
        assert_eq!(Request::decode(&[34, 0, 3]), Err(WireError::Trailing(1)));
        let reply = Reply::Usage {
            busy_ns: 5,
            elapsed_ns: 9,
        }
        .encode();
        let b = body(&reply);
        assert_eq!(b.len(), 2 + 16);
        for cut in 0..b.len() {
            assert!(Reply::decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = b.to_vec();
        long.push(0);
        assert_eq!(Reply::decode(&long), Err(WireError::Trailing(1)));
        // Its length is checked as any message's before it is read.
        let mut rd = &reply[..reply.len() - 1];
        assert!(Reply::read_from(&mut rd).is_err(), "a stream cut short");
    }

    #[test]
    fn truncated_padded_or_oversized_messages_are_errors() {
        for r in every_request() {
            let msg = r.encode();
            let b = body(&msg);
            for cut in 0..b.len() {
                assert!(Request::decode(&b[..cut]).is_err(), "{r:?} cut at {cut}");
            }
            let mut long = b.to_vec();
            long.push(0);
            assert_eq!(Request::decode(&long), Err(WireError::Trailing(1)));
        }
        assert_eq!(Request::decode(&[99, 0]), Err(WireError::Opcode(99)));
        // A batch holding what cannot be batched (a request with a data reply, a batch).
        for inner in [
            Request::MemAlloc {
                ctx: ContextId(1),
                bytes: 8,
            },
            Request::Batch(vec![]),
        ] {
            let mut m = Request::Batch(vec![]).encode();
            m[6..10].copy_from_slice(&1u32.to_le_bytes());
            let body = &inner.encode()[4..];
            m.extend_from_slice(&(body.len() as u32).to_le_bytes());
            m.extend_from_slice(body);
            assert!(
                matches!(Request::decode(&m[4..]), Err(WireError::NotBatchable(_))),
                "{inner:?}"
            );
        }
        // Batchability comes from the opcode alone, and it is what the variants say.
        for inner in every_request() {
            let mut m = Request::Batch(vec![]).encode();
            m[6..10].copy_from_slice(&1u32.to_le_bytes());
            let body = &inner.encode()[4..];
            m.extend_from_slice(&(body.len() as u32).to_le_bytes());
            m.extend_from_slice(body);
            let batchable = matches!(
                inner,
                Request::Launch { .. }
                    | Request::CopyHtoD { .. }
                    | Request::CopyDtoD { .. }
                    | Request::MemsetD8 { .. }
                    | Request::MemsetD32 { .. }
                    | Request::EventRecord { .. }
                    | Request::ContextSynchronize { .. }
                    | Request::StreamSynchronize { .. }
                    | Request::EventSynchronize { .. }
            );
            let decoded = Request::decode(&m[4..]);
            if batchable {
                assert_eq!(decoded, Ok(Request::Batch(vec![inner])));
            } else {
                assert!(
                    matches!(decoded, Err(WireError::NotBatchable(_))),
                    "{inner:?}"
                );
            }
        }
        // A request that may not be batched is refused before its fields are read: a
        // truncated module load in a batch is not batchable, whatever else is wrong with it.
        let mut m = Request::Batch(vec![]).encode();
        m[6..10].copy_from_slice(&1u32.to_le_bytes());
        m.extend_from_slice(&6u32.to_le_bytes());
        m.extend_from_slice(&[5, 0, 1, 0, 0, 0]);
        assert_eq!(Request::decode(&m[4..]), Err(WireError::NotBatchable(5)));
        assert!(body_len(u32::MAX.to_le_bytes()).is_err());
        // A copy announcing more than a message may carry is refused before any allocation.
        let mut m = Request::CopyDtoH {
            ctx: ContextId(1),
            src: 0,
            bytes: MAX_COPY_BYTES + 1,
            stream: StreamId(0),
        }
        .encode();
        assert!(matches!(
            Request::decode(&m[4..]),
            Err(WireError::TooLong { what: "copy", .. })
        ));
        // A byte string announcing 4 GiB in a short message.
        m = Request::ModuleLoad {
            ctx: ContextId(1),
            image: vec![],
        }
        .encode();
        m[10..14].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Request::decode(&m[4..]),
            Err(WireError::TooLong { .. })
        ));
        let mut bad_name = Request::Function {
            ctx: ContextId(1),
            module: ModuleId(1),
            name: "k".into(),
        }
        .encode();
        *bad_name.last_mut().unwrap() = 0xff;
        assert_eq!(Request::decode(&bad_name[4..]), Err(WireError::Utf8));
    }

    /// A body of batches nested `levels.len()` deep, each level `(before, after)` holding that
    /// many `ContextSynchronize` requests before and after the level below it (the innermost
    /// holds one). Written outside in, in one pass: a real guest's bytes, without the
    /// quadratic cost of wrapping a body level by level.
    fn nested(levels: &[(usize, usize)]) -> Vec<u8> {
        let sync = Request::ContextSynchronize { ctx: ContextId(1) }.encode()[4..].to_vec();
        let item = 4 + sync.len();
        let innermost = 6 + item;
        // The size of each level's body, from the innermost out.
        let mut sizes = vec![innermost; levels.len() + 1];
        for (d, &(before, after)) in levels.iter().enumerate().rev() {
            sizes[d] = 6 + (before + after) * item + 4 + sizes[d + 1];
        }
        let mut m = Vec::with_capacity(sizes[0]);
        let head = |m: &mut Vec<u8>, n: usize| {
            m.extend_from_slice(&BATCH_OPCODE.to_le_bytes());
            m.extend_from_slice(&(n as u32).to_le_bytes());
        };
        let push = |m: &mut Vec<u8>, n: usize| {
            for _ in 0..n {
                m.extend_from_slice(&(sync.len() as u32).to_le_bytes());
                m.extend_from_slice(&sync);
            }
        };
        for (d, &(before, _)) in levels.iter().enumerate() {
            head(&mut m, before + 1 + levels[d].1);
            push(&mut m, before);
            m.extend_from_slice(&(sizes[d + 1] as u32).to_le_bytes());
        }
        head(&mut m, 1);
        push(&mut m, 1);
        for &(_, after) in levels.iter().rev() {
            push(&mut m, after);
        }
        assert_eq!(m.len(), sizes[0]);
        m
    }

    #[test]
    fn twenty_thousand_nested_batches_are_refused_without_recursing() {
        // 20,000 levels, each a batch of one, in a 200 KB message: refused at the first inner
        // batch, from its opcode. Decoding each inner batch before checking it overflowed
        // the decoding thread's stack (an abort of the whole device process).
        let m = nested(&[(0, 0); 20_000]);
        assert!(m.len() > 200_000);
        assert_eq!(
            Request::decode(&m),
            Err(WireError::NotBatchable(BATCH_OPCODE))
        );
        // One level is a batch like any other.
        assert!(matches!(Request::decode(&nested(&[])), Ok(Request::Batch(r)) if r.len() == 1));
    }

    #[test]
    fn randomly_nested_batches_are_refused_at_their_first_inner_batch() {
        // A fixed xorshift sequence: the same shapes on every run.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n) as usize
        };
        for _ in 0..50 {
            let depth = 1 + next(40_000);
            let levels: Vec<(usize, usize)> = (0..depth).map(|_| (next(4), next(4))).collect();
            assert_eq!(
                Request::decode(&nested(&levels)),
                Err(WireError::NotBatchable(BATCH_OPCODE)),
                "{depth} levels"
            );
        }
    }
}
