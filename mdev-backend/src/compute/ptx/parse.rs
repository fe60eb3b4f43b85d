//! PTX text → [`Parsed`]: directives, declarations and instructions decoded, every register,
//! label, variable and function resolved. Anything the executor does not implement is refused
//! here with its line, never met at run time.
//!
//! A guest's text is hostile: the parse costs time linear in it (a name is one map probe
//! whatever the nesting of scopes), every host byte it makes is charged to the VM's budget
//! through a [`Meter`] before it is made, and the meter's cancel flag stops it within a few
//! thousand tokens.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::exec::KPARAM_WINDOW;
use super::ir::*;
use super::lex::{Lexer, Tok, Token};
use super::{GlobalVar, VarSpace};
use super::{MAX_INSTRUCTIONS_PER_MODULE, MAX_REGISTERS_PER_THREAD, MAX_VARIABLE_BYTES};
use crate::budget::{Charge, MemoryBudget, OverBudget};
use crate::compute::ComputeError;

/// Bytes a [`Meter`] reserves from the budget at a time: the shared counter is touched once
/// per step, and a parse holds at most one step it has not used.
const METER_STEP: u64 = 64 << 10;
/// Tokens read between two looks at the cancel flag (tens of microseconds of parsing).
const CANCEL_CHECK_TOKENS: u32 = 4096;
/// Tokens in one instruction's operands: they are held while it is decoded, so this bounds
/// them without charging them. nvcc's longest, a call with its parameter list, has a few
/// hundred.
const MAX_INSTRUCTION_TOKENS: usize = 4096;
/// Host bytes one entry of a name table costs besides its name's bytes (the entry, the
/// table's control byte and spare room): the estimate charged per name.
const MAP_ENTRY_BYTES: u64 = 64;

/// Why a parse (or a module load's decompression) stopped before its end: not the text's
/// fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// What it would hold takes the VM past its memory budget.
    OverBudget(OverBudget),
    /// The load was cancelled: the VM's device was reset or went away.
    Cancelled,
}

impl Stop {
    /// The error a guest is answered with.
    pub(crate) fn error(self) -> ComputeError {
        match self {
            Stop::OverBudget(e) => ComputeError::OutOfMemory(format!("module: {e}")),
            Stop::Cancelled => {
                ComputeError::LaunchTimeout("module load cancelled: its owner went away".into())
            }
        }
    }
}

/// The host bytes a module load holds, charged to the VM's budget before they are held (in
/// steps of [`METER_STEP`]), and the flag that cancels the load.
#[derive(Debug)]
pub(crate) struct Meter<'a> {
    charge: Charge,
    /// Bytes counted; `charge` holds these and at most one step more.
    used: u64,
    cancel: &'a AtomicBool,
}

impl<'a> Meter<'a> {
    pub(crate) fn new(budget: &Arc<MemoryBudget>, cancel: &'a AtomicBool) -> Meter<'a> {
        Meter {
            charge: Charge::empty(budget),
            used: 0,
            cancel,
        }
    }

    /// Fails once the load is cancelled.
    pub(crate) fn check(&self) -> Result<(), Stop> {
        if self.cancel.load(Ordering::Relaxed) {
            Err(Stop::Cancelled)
        } else {
            Ok(())
        }
    }

    /// Counts `bytes` more, reserving them first; looks at the cancel flag at each step.
    fn take(&mut self, bytes: u64) -> Result<(), Stop> {
        // Saturated, it is more than any budget grants.
        let used = self.used.saturating_add(bytes);
        if used > self.charge.bytes() {
            self.check()?;
            let short = used - self.charge.bytes();
            // A step ahead when it fits, else exactly what is needed.
            if self.charge.grow(short.max(METER_STEP)).is_err() {
                self.charge.grow(short).map_err(Stop::OverBudget)?;
            }
        }
        self.used = used;
        Ok(())
    }

    /// Counts `bytes` fewer (what was freed), giving the budget back all but a step.
    fn give_back(&mut self, bytes: u64) {
        self.used = self.used.saturating_sub(bytes);
        let spare = self.charge.bytes() - self.used;
        if spare > METER_STEP {
            self.charge.shrink(spare - METER_STEP);
        }
    }

    /// The charge of exactly the bytes still counted.
    fn finish(mut self) -> Charge {
        let spare = self.charge.bytes() - self.used;
        self.charge.shrink(spare);
        self.charge
    }
}

/// Pushes `item`, growing `v` by charged steps: its spare capacity is counted too.
fn push_charged<T>(v: &mut Vec<T>, item: T, meter: &mut Meter<'_>) -> Result<(), Stop> {
    if v.len() == v.capacity() {
        let more = v.capacity().max(64);
        meter.take((more as u64).saturating_mul(size_of::<T>() as u64))?;
        v.reserve_exact(more);
    }
    v.push(item);
    Ok(())
}

/// Kernel parameter layouts by function index: (offset, size, align) each, and total bytes.
pub(crate) type KernelParams = HashMap<u32, (Vec<(u32, u32, u32)>, u32)>;

/// A variable's initial bytes and the (offset, module variable) pairs whose device address
/// goes at offset.
type Init = (Vec<u8>, Vec<(u32, u32)>);

/// A declared variable.
struct VarDecl {
    name: String,
    size: u32,
    align: u32,
    init: Option<Init>,
    /// `name<N>`: N variables, `name0` to `nameN-1` (function scope only).
    copies: Option<u32>,
}

/// Linkage of a module-scope declaration: how images linked together share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Linkage {
    /// Seen by its own image only.
    Internal,
    /// `.extern`: defined in another image.
    Extern,
    /// `.visible`: defined here, seen by every image.
    Visible,
    /// `.weak` / `.common`: defined here unless another image defines it too.
    Weak,
}

/// A parse failure: the line and what is wrong.
pub(crate) type PResult<T> = Result<T, (u32, String)>;

/// A module after parsing.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub code: Vec<Inst>,
    pub funcs: Vec<Function>,
    pub globals: Vec<GlobalVar>,
    /// Declared width in bits of each register (1 for predicates).
    pub reg_bits: Vec<u8>,
    pub shared_bytes: u32,
    pub local_bytes: u32,
    pub fparam_bytes: u32,
    pub kernel_params: KernelParams,
}

#[derive(Debug, Clone, Copy)]
enum Name {
    Reg(u32),
    Var(SymRef, u32),
    /// A `.v2`/`.v4` register of this many elements, from this register on: they are also
    /// named `NAME.x`, `NAME.y`, ...
    Vector(u8, u32),
    Func(u32),
}

/// Module `.global` and `.const` variables of one module (each is an allocation at load).
const MAX_MODULE_VARIABLES: usize = 4096;

/// Element names of vector registers.
const VECTOR_ELEMENTS: [&str; 4] = ["x", "y", "z", "w"];

/// Host bytes one definition of a function-scope name holds (its place in a name's stack and
/// in the order of definitions).
const DEFINITION_BYTES: u64 = (size_of::<Name>() + size_of::<u32>()) as u64;
/// Host bytes one open scope holds.
const OPEN_SCOPE_BYTES: u64 = size_of::<usize>() as u64;

/// The names of a function's nested scopes. A name maps to a slot whose stack holds its
/// definitions, innermost last: a lookup is one map probe whatever the nesting, and closing a
/// scope pops exactly the definitions it made, so scopes cost time linear in the text.
#[derive(Debug, Default)]
struct Scopes {
    slots: HashMap<String, u32>,
    stacks: Vec<Vec<Name>>,
    /// The slot of each definition in the open scopes, in the order they were made.
    made: Vec<u32>,
    /// Where each open scope's definitions start in `made`.
    open: Vec<usize>,
}

impl Scopes {
    fn get(&self, name: &str) -> Option<Name> {
        let &slot = self.slots.get(name)?;
        self.stacks[slot as usize].last().copied()
    }

    fn open(&mut self) {
        self.open.push(self.made.len());
    }

    /// Closes the innermost scope: its definitions are gone. The bytes that freed.
    fn close(&mut self) -> u64 {
        let Some(from) = self.open.pop() else {
            return 0;
        };
        let gone = self.made.len() - from;
        for slot in self.made.drain(from..) {
            self.stacks[slot as usize].pop();
        }
        OPEN_SCOPE_BYTES + gone as u64 * DEFINITION_BYTES
    }

    fn is_open(&self) -> bool {
        !self.open.is_empty()
    }

    /// Defines `name` in the innermost scope, hiding any outer definition until it closes.
    fn define(&mut self, name: String, n: Name) {
        let next = self.stacks.len() as u32;
        let slot = *self.slots.entry(name).or_insert(next);
        if slot == next {
            self.stacks.push(Vec::new());
        }
        self.stacks[slot as usize].push(n);
        self.made.push(slot);
    }
}

struct Parser<'a> {
    lexer: Lexer<'a>,
    /// The next token, lexed but not consumed.
    ahead: Option<Token<'a>>,
    /// Tokens read since the cancel flag was last looked at.
    since_check: u32,
    meter: Meter<'a>,
    /// Why the parse stopped, when it was not the text's fault.
    stop: Option<Stop>,
    /// Bytes charged for what lives until the current function ends (scopes, labels).
    function_bytes: u64,
    /// Bytes charged for what lives until the parse ends (name tables, fixups).
    parse_bytes: u64,
    scopes: Scopes,
    /// The current function's labels.
    labels: HashMap<String, u32>,
    /// The current function's branches: (instruction, label, line).
    bra_fixups: Vec<(usize, String, u32)>,
    code: Vec<Inst>,
    funcs: Vec<Function>,
    /// Functions with linkage (`.visible`, `.extern`, `.weak`), shared by all images.
    func_index: HashMap<String, u32>,
    /// Each image's internal functions; the last is the image being parsed.
    image_funcs: Vec<HashMap<String, u32>>,
    globals: Vec<GlobalVar>,
    /// The current image's module-scope variables.
    module_names: HashMap<String, Name>,
    /// Variables with linkage, shared by all images: the name, whether an image defined it,
    /// and the line that declared it.
    linked_vars: HashMap<String, (Name, bool, u32)>,
    reg_bits: Vec<u8>,
    /// The end of the module's and device functions' static shared variables.
    shared_bytes: u32,
    /// While a kernel's body is parsed, the end of its own shared variables.
    entry_shared: Option<u32>,
    /// The largest end of any kernel's own shared variables.
    entry_shared_max: u32,
    local_bytes: u32,
    fparam_bytes: u32,
    kernel_params: KernelParams,
    /// Calls to resolve once every image is parsed: (instruction, name, line, image).
    call_fixups: Vec<(usize, String, u32, usize)>,
}

fn err<T>(line: u32, msg: impl Into<String>) -> PResult<T> {
    Err((line, msg.into()))
}

fn align_up(v: u32, align: u32, line: u32) -> PResult<u32> {
    let align = align.max(1);
    v.checked_next_multiple_of(align)
        .ok_or((line, "variable layout overflows".to_string()))
}

/// Bytes of a parse error's message: it may quote a guest's name, which can be as long as
/// its text.
const MAX_MESSAGE_BYTES: usize = 256;

/// Why a parse failed.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The text: the image (by index), the line and what is wrong.
    Invalid(usize, u32, String),
    Stopped(Stop),
}

/// A failure of the text, its message cut to [`MAX_MESSAGE_BYTES`].
fn invalid(image: usize, line: u32, mut msg: String) -> Failure {
    if msg.len() > MAX_MESSAGE_BYTES {
        let mut cut = MAX_MESSAGE_BYTES;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
        msg.push_str("...");
    }
    Failure::Invalid(image, line, msg)
}

/// Parses PTX modules and links them into one: each image's internal names stay its own,
/// `.extern` declarations resolve to the `.visible` (or `.weak`) definitions of any image, as
/// `cuLinkAddData` + `cuLinkComplete` do. Every byte the parse holds is charged to `meter`
/// first; the returned charge holds what the parsed module keeps, the rest given back.
pub(crate) fn parse<'a>(images: &[&'a str], meter: Meter<'a>) -> Result<(Parsed, Charge), Failure> {
    let mut p = Parser {
        lexer: Lexer::new(""),
        ahead: None,
        since_check: 0,
        meter,
        stop: None,
        function_bytes: 0,
        parse_bytes: 0,
        scopes: Scopes::default(),
        labels: HashMap::new(),
        bra_fixups: Vec::new(),
        code: Vec::new(),
        funcs: Vec::new(),
        func_index: HashMap::new(),
        image_funcs: Vec::new(),
        globals: Vec::new(),
        module_names: HashMap::new(),
        linked_vars: HashMap::new(),
        reg_bits: Vec::new(),
        shared_bytes: 0,
        entry_shared: None,
        entry_shared_max: 0,
        local_bytes: 0,
        fparam_bytes: 0,
        kernel_params: HashMap::new(),
        call_fixups: Vec::new(),
    };
    for (i, text) in images.iter().enumerate() {
        p.lexer = Lexer::new(text);
        p.ahead = None;
        p.module_names.clear();
        p.image_funcs.push(HashMap::new());
        let parsed = p.module();
        if let Some(stop) = p.stop {
            return Err(Failure::Stopped(stop));
        }
        parsed.map_err(|(line, msg)| invalid(i, line, msg))?;
    }
    let last = images.len().saturating_sub(1);
    for (name, (_, defined, line)) in &p.linked_vars {
        if !defined {
            return Err(invalid(
                last,
                *line,
                format!("variable {name} is declared but never defined"),
            ));
        }
    }
    for (at, name, line, image) in std::mem::take(&mut p.call_fixups) {
        let fail = |msg: String| Err(invalid(image, line, msg));
        let Some(&f) = p.image_funcs[image]
            .get(&name)
            .or_else(|| p.func_index.get(&name))
        else {
            return fail(format!("call of undefined function {name}"));
        };
        let declared_only =
            p.funcs[f as usize].end == p.funcs[f as usize].start && !p.funcs[f as usize].entry;
        let callee = match (declared_only, name.as_str()) {
            (false, _) => Callee::Func(f),
            // What the CUDA driver provides to every module.
            (true, "malloc") => Callee::Malloc,
            (true, "free") => Callee::Free,
            (true, "vprintf") => Callee::Vprintf,
            (true, "__assertfail") => Callee::AssertFail,
            (true, _) => return fail(format!("call of {name}, declared but never defined")),
        };
        if let Op::Call {
            callee: c,
            ret,
            args,
        } = &mut p.code[at].op
        {
            let fits = match callee {
                Callee::Malloc => args.len() == 1 && ret.is_some(),
                Callee::Free => args.len() == 1,
                _ => true,
            };
            if !fits {
                return fail(format!("bad arguments to {name}"));
            }
            *c = callee;
        }
    }
    p.meter.give_back(p.parse_bytes);
    let charge = p.meter.finish();
    let parsed = Parsed {
        code: p.code,
        funcs: p.funcs,
        globals: p.globals,
        reg_bits: p.reg_bits,
        shared_bytes: p.shared_bytes.max(p.entry_shared_max),
        local_bytes: p.local_bytes,
        fparam_bytes: p.fparam_bytes,
        kernel_params: p.kernel_params,
    };
    Ok((parsed, charge))
}

impl<'a> Parser<'a> {
    /// Charges `bytes` more for what the parse builds; the parse stops when they do not fit
    /// or the load is cancelled.
    fn spend(&mut self, bytes: u64) -> PResult<()> {
        self.meter.take(bytes).map_err(|s| self.stopped(s))
    }

    /// Records why the parse stops; the error it returns is replaced by that reason.
    fn stopped(&mut self, stop: Stop) -> (u32, String) {
        self.stop = Some(stop);
        (0, format!("{stop:?}"))
    }

    /// [`Parser::spend`] for what lives until the current function ends.
    fn spend_for_function(&mut self, bytes: u64) -> PResult<()> {
        self.spend(bytes)?;
        self.function_bytes += bytes;
        Ok(())
    }

    /// [`Parser::spend`] for what lives until the parse ends.
    fn spend_for_parse(&mut self, bytes: u64) -> PResult<()> {
        self.spend(bytes)?;
        self.parse_bytes += bytes;
        Ok(())
    }

    /// Defines a function-scope name, charged until its scope closes.
    fn define(&mut self, name: String, n: Name) -> PResult<()> {
        if !self.scopes.slots.contains_key(&name) {
            self.spend_for_function(
                name.len() as u64 + MAP_ENTRY_BYTES + size_of::<Vec<Name>>() as u64,
            )?;
        }
        self.spend(DEFINITION_BYTES)?;
        self.scopes.define(name, n);
        Ok(())
    }

    fn open_scope(&mut self) -> PResult<()> {
        self.spend(OPEN_SCOPE_BYTES)?;
        self.scopes.open();
        Ok(())
    }

    /// Closes the innermost scope; whether one is still open.
    fn close_scope(&mut self) -> bool {
        let freed = self.scopes.close();
        self.meter.give_back(freed);
        self.scopes.is_open()
    }

    /// The line of the next token that is not a newline (that of a newline still to be
    /// skipped is the line before: an instruction would be blamed on the one above it).
    fn line(&mut self) -> u32 {
        self.peek();
        self.ahead.map_or(self.lexer.line(), |t| t.line)
    }

    /// Lexes the next token into `ahead` unless it holds one; `None` at the end of the text,
    /// or when the load was cancelled (recorded: the parse then stops).
    fn fill(&mut self) -> Option<Token<'a>> {
        if self.ahead.is_none() && self.stop.is_none() {
            match self.lexer.next(&self.meter) {
                Ok(t) => self.ahead = t,
                Err(stop) => self.stop = Some(stop),
            }
        }
        self.ahead
    }

    /// The next token that is not a newline.
    fn peek(&mut self) -> Option<&Tok<'a>> {
        while let Some(Token {
            tok: Tok::Newline, ..
        }) = self.fill()
        {
            self.ahead = None;
        }
        self.ahead.as_ref().map(|t| &t.tok)
    }

    /// Consumes the token [`Parser::peek`] returned.
    fn bump(&mut self) {
        self.ahead = None;
    }

    fn next(&mut self) -> PResult<Tok<'a>> {
        self.since_check += 1;
        if self.since_check >= CANCEL_CHECK_TOKENS {
            self.since_check = 0;
            self.meter.check().map_err(|s| self.stopped(s))?;
        }
        let line = self.line();
        let t = self
            .ahead
            .take()
            .ok_or((line, "unexpected end of text".to_string()))?;
        Ok(t.tok)
    }

    fn expect(&mut self, c: char) -> PResult<()> {
        let line = self.line();
        match self.next()? {
            Tok::Punct(p) if p == c => Ok(()),
            t => err(line, format!("expected '{c}', found {t:?}")),
        }
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.bump();
            true
        } else {
            false
        }
    }

    fn word(&mut self) -> PResult<&'a str> {
        let line = self.line();
        match self.next()? {
            Tok::Word(w) => Ok(w),
            t => err(line, format!("expected a name, found {t:?}")),
        }
    }

    fn int(&mut self) -> PResult<u64> {
        let line = self.line();
        match self.next()? {
            Tok::Int(v) => Ok(v),
            t => err(line, format!("expected an integer, found {t:?}")),
        }
    }

    /// Skips to the end of the current line (directives without a semicolon).
    fn skip_line(&mut self) {
        while let Some(t) = self.fill() {
            self.bump();
            if t.tok == Tok::Newline {
                break;
            }
        }
    }

    fn skip_statement(&mut self) -> PResult<()> {
        loop {
            if let Tok::Punct(';') = self.next()? {
                return Ok(());
            }
        }
    }

    fn module(&mut self) -> PResult<()> {
        let mut linkage = Linkage::Internal;
        while let Some(tok) = self.peek().copied() {
            let line = self.line();
            match tok {
                Tok::Directive(d) => match d {
                    ".version" | ".target" | ".address_size" | ".file" | ".loc" => self.skip_line(),
                    ".visible" => {
                        self.bump();
                        linkage = Linkage::Visible;
                    }
                    ".extern" => {
                        self.bump();
                        linkage = Linkage::Extern;
                    }
                    ".weak" | ".common" => {
                        self.bump();
                        linkage = Linkage::Weak;
                    }
                    ".entry" | ".func" => {
                        self.bump();
                        self.function(
                            d == ".entry",
                            std::mem::replace(&mut linkage, Linkage::Internal),
                        )?;
                    }
                    ".global" | ".const" | ".shared" => {
                        self.bump();
                        self.module_var(d, std::mem::replace(&mut linkage, Linkage::Internal))?;
                    }
                    // DWARF from `-lineinfo` (the names `.loc` refers to): no part of the
                    // program, skipped whole; other sections are refused.
                    ".section" => {
                        self.bump();
                        match self.peek().copied() {
                            Some(Tok::Directive(name)) if name.starts_with(".debug") => {
                                self.bump();
                                self.expect('{')?;
                                while self.peek().is_some() && self.next()? != Tok::Punct('}') {}
                            }
                            _ => {
                                return err(line, "sections other than DWARF are not supported");
                            }
                        }
                    }
                    _ => return err(line, format!("unsupported module directive {d}")),
                },
                Tok::Punct(';') => self.bump(),
                t => return err(line, format!("unexpected {t:?} at module scope")),
            }
        }
        Ok(())
    }

    /// `[.align N] .type name[N]... [= init];` after its state space.
    fn var_decl(&mut self) -> PResult<VarDecl> {
        let line = self.line();
        let mut align = 0;
        let mut ty = None;
        while let Some(Tok::Directive(d)) = self.peek().copied() {
            self.bump();
            match d {
                ".align" => align = u32::try_from(self.int()?).unwrap_or(u32::MAX),
                ".ptr" | ".global" | ".const" | ".shared" | ".local" => {}
                ".v2" | ".v4" => return err(line, "vector variables are not supported"),
                _ => match Ty::parse(&d[1..]) {
                    Some(t) => ty = Some(t),
                    None => return err(line, format!("unsupported variable attribute {d}")),
                },
            }
        }
        let ty = ty.ok_or((line, "variable without a type".to_string()))?;
        if ty == Ty::Pred {
            return err(line, "predicate variables are not supported");
        }
        let name = self.word()?;
        // `%P<2>`: variables %P0 and %P1.
        let copies = if self.eat('<') {
            let n = self.int()?;
            self.expect('>')?;
            Some(
                u32::try_from(n)
                    .ok()
                    .filter(|&n| n <= 1024)
                    .ok_or((line, format!("{n} parameterized variables")))?,
            )
        } else {
            None
        };
        let mut count: u64 = 1;
        let mut unsized_array = false;
        while self.eat('[') {
            if self.eat(']') {
                unsized_array = true;
                continue;
            }
            count = count
                .checked_mul(self.int()?)
                .ok_or((line, "array size overflows".to_string()))?;
            self.expect(']')?;
        }
        let size = count
            .checked_mul(u64::from(ty.bytes()))
            .filter(|&s| s <= MAX_VARIABLE_BYTES && !(unsized_array && count != 1))
            .ok_or((line, format!("variable {name} is too large")))?;
        let size = if unsized_array { 0 } else { size as u32 };
        let align = if align == 0 { ty.bytes() } else { align };
        if !align.is_power_of_two() || align > 4096 {
            return err(line, format!("bad alignment {align}"));
        }
        let init = if self.eat('=') {
            Some(self.initializer(ty, size)?)
        } else {
            None
        };
        Ok(VarDecl {
            name: name.to_string(),
            size,
            align,
            init,
            copies,
        })
    }

    /// `= 5`, `= {1, 2}`, nested lists, and addresses (`generic(var)`, `var`, `function`): the
    /// bytes, zero-filled to `size`, and where a variable's device address goes.
    fn initializer(&mut self, ty: Ty, size: u32) -> PResult<Init> {
        let line = self.line();
        // The bytes are the variable's: charged whole, as they end `size` long.
        self.spend(u64::from(size))?;
        let mut out = Vec::new();
        let mut relocs = Vec::new();
        let mut depth = 0;
        loop {
            match self.next()? {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => depth -= 1,
                Tok::Punct(',') => {}
                Tok::Punct('-') => {
                    let v = self.literal_value(ty, true, line)?;
                    out.extend_from_slice(&v.to_le_bytes()[..ty.bytes() as usize]);
                }
                t @ (Tok::Int(_) | Tok::F32(_) | Tok::F64(_) | Tok::Float(_)) => {
                    let v = literal_of(t, ty, false, line)?;
                    out.extend_from_slice(&v.to_le_bytes()[..ty.bytes() as usize]);
                }
                Tok::Word(mut w) => {
                    if ty.bits() != 64 {
                        return err(line, "an address initialises only 64-bit variables");
                    }
                    if w == "generic" {
                        self.expect('(')?;
                        w = self.word()?;
                        self.expect(')')?;
                    }
                    let offset = u32::try_from(out.len()).unwrap_or(u32::MAX);
                    let value = match self.lookup(w) {
                        Some(Name::Var(SymRef::Global(g), _)) => {
                            self.spend(size_of::<(u32, u32)>() as u64)?;
                            relocs.push((offset, g));
                            0
                        }
                        Some(Name::Func(f)) => func_address(f),
                        _ => return err(line, format!("{w} is not a global variable or function")),
                    };
                    out.extend_from_slice(&value.to_le_bytes());
                }
                t => return err(line, format!("unsupported initializer {t:?}")),
            }
            if out.len() > size as usize {
                return err(line, "initializer larger than its variable");
            }
            if depth <= 0 {
                break;
            }
        }
        out.resize(size as usize, 0);
        Ok((out, relocs))
    }

    fn literal_value(&mut self, ty: Ty, negative: bool, line: u32) -> PResult<u64> {
        literal_of(self.next()?, ty, negative, line)
    }

    fn module_var(&mut self, space: &str, linkage: Linkage) -> PResult<()> {
        let line = self.line();
        let mut v = self.var_decl()?;
        self.expect(';')?;
        if v.copies.is_some() {
            return err(line, "parameterized module variables are not supported");
        }
        let defines = linkage != Linkage::Extern;
        if linkage != Linkage::Internal {
            if let Some(&(name, defined, _)) = self.linked_vars.get(&v.name) {
                let Name::Var(sym, size) = name else {
                    return err(line, format!("{} is not a variable", v.name));
                };
                if defines && defined && linkage != Linkage::Weak {
                    return err(line, format!("{} defined twice", v.name));
                }
                if defines && !defined {
                    match sym {
                        SymRef::Global(g) => self.define_global(g, space, &mut v)?,
                        _ if v.size > size => {
                            return err(line, format!("{} is larger than declared", v.name));
                        }
                        _ => {}
                    }
                    self.linked_vars.insert(v.name.clone(), (name, true, line));
                }
                self.module_name(v.name, name)?;
                return Ok(());
            }
        }
        let sym = match space {
            ".shared" => self.shared_var(v.size, v.align, line)?,
            _ => {
                let index = u32::try_from(self.globals.len()).unwrap_or(u32::MAX);
                if self.globals.len() >= MAX_MODULE_VARIABLES {
                    return err(line, "too many module variables");
                }
                self.spend(v.name.len() as u64)?;
                let g = GlobalVar {
                    name: v.name.clone(),
                    space: VarSpace::Global,
                    size: 0,
                    align: 1,
                    init: Vec::new(),
                    relocs: Vec::new(),
                };
                push_charged(&mut self.globals, g, &mut self.meter).map_err(|s| self.stopped(s))?;
                self.define_global(index, space, &mut v)?;
                SymRef::Global(index)
            }
        };
        let name = Name::Var(sym, v.size);
        if linkage != Linkage::Internal {
            // An `.extern .shared` array without a size is the dynamic shared memory.
            let defined = defines || sym == SymRef::DynShared;
            self.spend_for_parse(v.name.len() as u64 + MAP_ENTRY_BYTES)?;
            self.linked_vars
                .insert(v.name.clone(), (name, defined, line));
        }
        self.module_name(v.name, name)
    }

    /// Names a module-scope variable for the rest of the image.
    fn module_name(&mut self, name: String, n: Name) -> PResult<()> {
        self.spend_for_parse(name.len() as u64 + MAP_ENTRY_BYTES)?;
        self.module_names.insert(name, n);
        Ok(())
    }

    /// Gives module variable `g` the declaration's space, size and initial value (taken from
    /// the declaration; zeros, charged here, where it has none).
    fn define_global(&mut self, g: u32, space: &str, v: &mut VarDecl) -> PResult<()> {
        let (init, relocs) = match v.init.take() {
            Some(init) => init,
            None => {
                self.spend(u64::from(v.size))?;
                Default::default()
            }
        };
        let size = v.size as usize;
        let g = &mut self.globals[g as usize];
        g.space = if space == ".const" {
            VarSpace::Const
        } else {
            VarSpace::Global
        };
        g.size = u64::from(v.size);
        g.align = v.align;
        g.init = if init.is_empty() { vec![0; size] } else { init };
        g.relocs = relocs;
        Ok(())
    }

    /// Lays out a static shared variable. A kernel's own (function-scope) variables follow
    /// the module's and those of device functions, and share their place with other kernels'
    /// own: a launch runs one kernel, so the limit is per kernel, as on a GPU (a module of
    /// many CUB kernels, each with its own shared storage, would otherwise add them all up).
    fn shared_var(&mut self, size: u32, align: u32, line: u32) -> PResult<SymRef> {
        if size == 0 {
            return Ok(SymRef::DynShared);
        }
        let start = match self.entry_shared {
            Some(own) => own,
            None => self.shared_bytes.max(self.entry_shared_max),
        };
        let offset = align_up(start, align, line)?;
        let end = offset
            .checked_add(size)
            .filter(|&e| e <= super::MAX_SHARED_BYTES)
            .ok_or((line, "static shared memory past the limit".to_string()))?;
        match &mut self.entry_shared {
            Some(own) => *own = end,
            None => self.shared_bytes = end,
        }
        Ok(SymRef::Shared(offset))
    }

    /// `(.param ...)` lists of a function head: offsets in `area` (kernel buffer or scratch),
    /// each name defined in the function's (open) scope.
    fn param_list(&mut self, kernel: bool) -> PResult<Vec<(u32, u32, u32)>> {
        let mut out = Vec::new();
        let mut kernel_offset = 0u32;
        self.expect('(')?;
        if self.eat(')') {
            return Ok(out);
        }
        loop {
            let line = self.line();
            match self.next()? {
                Tok::Directive(d) if d == ".param" || d == ".reg" => {}
                t => return err(line, format!("expected .param, found {t:?}")),
            }
            let VarDecl {
                name,
                size,
                align,
                copies,
                ..
            } = self.var_decl()?;
            if copies.is_some() {
                return err(line, "parameterized parameters are not supported");
            }
            let offset = if kernel {
                let o = align_up(kernel_offset, align, line)?;
                kernel_offset = o
                    .checked_add(size)
                    .filter(|&e| e <= super::MAX_PARAM_BYTES)
                    .ok_or((line, "kernel parameters past the limit".to_string()))?;
                o
            } else {
                self.fparam(size, align, line)?
            };
            let sym = if kernel {
                SymRef::KernelParam(offset)
            } else {
                SymRef::FuncParam(offset)
            };
            self.define(name, Name::Var(sym, size))?;
            self.spend(size_of::<(u32, u32, u32)>() as u64)?;
            out.push((offset, size, align));
            if self.eat(')') {
                return Ok(out);
            }
            self.expect(',')?;
        }
    }

    fn fparam(&mut self, size: u32, align: u32, line: u32) -> PResult<u32> {
        let o = align_up(self.fparam_bytes, align, line)?;
        self.fparam_bytes = o
            .checked_add(size)
            .filter(|&e| e <= super::MAX_FPARAM_BYTES)
            .ok_or((line, "function parameters past the limit".to_string()))?;
        Ok(o)
    }

    fn function(&mut self, entry: bool, linkage: Linkage) -> PResult<()> {
        let line = self.line();
        let first_reg = self.reg_bits.len() as u32;
        // The parameters' scope, which the body's braces close.
        self.open_scope()?;
        let mut ret = None;
        if !entry && self.peek() == Some(&Tok::Punct('(')) {
            let r = self.param_list(false)?;
            match r.as_slice() {
                [] => {}
                [(o, s, _)] => ret = Some((*o, *s)),
                _ => return err(line, "more than one return parameter"),
            }
        }
        let name = self.word()?;
        let params = if self.peek() == Some(&Tok::Punct('(')) {
            self.param_list(entry)?
        } else {
            Vec::new()
        };
        // Performance directives (.maxntid, .reqntid, .minnctapersm, .noreturn, ...).
        while let Some(Tok::Directive(_)) = self.peek() {
            self.bump();
            while matches!(self.peek(), Some(Tok::Int(_) | Tok::Punct(','))) {
                self.bump();
            }
        }
        let known = self
            .image_funcs
            .last()
            .and_then(|m| m.get(name))
            .or_else(|| {
                (linkage != Linkage::Internal)
                    .then(|| self.func_index.get(name))
                    .flatten()
            })
            .copied();
        let declaration = self.peek() == Some(&Tok::Punct(';'));
        let index = match known {
            Some(i) if self.funcs[i as usize].end == self.funcs[i as usize].start => i,
            // A declaration of what is defined already, or a second weak definition (which
            // is parsed and left unused).
            Some(i) if declaration => i,
            Some(_) if linkage == Linkage::Weak => self.new_function(name, entry)?,
            Some(_) => return err(line, format!("{name} defined twice")),
            None => {
                let i = self.new_function(name, entry)?;
                if linkage == Linkage::Internal {
                    self.spend_for_parse(name.len() as u64 + MAP_ENTRY_BYTES)?;
                    self.image_funcs
                        .last_mut()
                        .expect("an image")
                        .insert(name.to_string(), i);
                }
                i
            }
        };
        if linkage != Linkage::Internal && !self.func_index.contains_key(name) {
            self.spend_for_parse(name.len() as u64 + MAP_ENTRY_BYTES)?;
            self.func_index.insert(name.to_string(), index);
        }
        if self.eat(';') {
            // A declaration (prototype); its parameters are laid out again at the definition.
            let f = &mut self.funcs[index as usize];
            if f.start == f.end {
                f.params = params;
                f.ret = ret;
            }
            self.end_function();
            return Ok(());
        }
        // The function keeps its parameters; a kernel's are kept twice more (its layout and
        // the module's kernel list, with its name).
        let param_bytes = (params.len() * size_of::<(u32, u32, u32)>()) as u64;
        if entry {
            self.spend(2 * param_bytes + MAP_ENTRY_BYTES + name.len() as u64)?;
        }
        let start = self.code.len();
        self.expect('{')?;
        if entry {
            self.entry_shared = Some(self.shared_bytes);
        }
        self.body()?;
        if let Some(end) = self.entry_shared.take() {
            self.entry_shared_max = self.entry_shared_max.max(end);
        }
        for (at, label, line) in std::mem::take(&mut self.bra_fixups) {
            let Some(&target) = self.labels.get(&label) else {
                return err(line, format!("branch to undefined label {label}"));
            };
            if let Op::Bra { target: t } = &mut self.code[at].op {
                *t = target;
            }
        }
        // A function falls off its end into an implicit return.
        self.push(Inst {
            guard: None,
            op: if entry { Op::Exit } else { Op::Ret },
            line,
        })?;
        let f = &mut self.funcs[index as usize];
        f.start = start as u32;
        f.end = self.code.len() as u32;
        f.regs = first_reg..self.reg_bits.len() as u32;
        f.params = params.clone();
        f.ret = ret;
        f.entry = entry;
        if entry {
            let bytes = params.iter().map(|&(o, s, _)| o + s).max().unwrap_or(0);
            self.kernel_params.insert(index, (params, bytes));
        }
        self.end_function();
        Ok(())
    }

    /// Frees what lived for the function just parsed (its scopes, labels and branches).
    fn end_function(&mut self) {
        while self.close_scope() {}
        self.scopes = Scopes::default();
        self.labels = HashMap::new();
        self.bra_fixups = Vec::new();
        self.meter
            .give_back(std::mem::take(&mut self.function_bytes));
    }

    fn new_function(&mut self, name: &str, entry: bool) -> PResult<u32> {
        let i = u32::try_from(self.funcs.len()).unwrap_or(u32::MAX);
        self.spend(name.len() as u64)?;
        let f = Function {
            name: name.to_string(),
            entry,
            start: 0,
            end: 0,
            regs: 0..0,
            params: Vec::new(),
            ret: None,
        };
        push_charged(&mut self.funcs, f, &mut self.meter).map_err(|s| self.stopped(s))?;
        Ok(i)
    }

    /// Appends an instruction, charged with what its operation holds besides itself.
    fn push(&mut self, inst: Inst) -> PResult<()> {
        if self.code.len() >= MAX_INSTRUCTIONS_PER_MODULE {
            return err(inst.line, "module has too many instructions");
        }
        let held = match &inst.op {
            Op::Pack { parts, .. } => parts.capacity() * size_of::<Src>(),
            Op::Unpack { ds, .. } => ds.capacity() * size_of::<u32>(),
            Op::Call { args, .. } => args.capacity() * size_of::<(u32, u32)>(),
            _ => 0,
        };
        self.spend(held as u64)?;
        push_charged(&mut self.code, inst, &mut self.meter).map_err(|s| self.stopped(s))
    }

    /// What `name` means here: the innermost function-scope definition, else the image's
    /// module-scope names, else a function.
    fn lookup(&self, name: &str) -> Option<Name> {
        self.scopes
            .get(name)
            .or_else(|| self.module_names.get(name).copied())
            .or_else(|| {
                let funcs = self.image_funcs.last()?;
                funcs
                    .get(name)
                    .or_else(|| self.func_index.get(name))
                    .map(|&f| Name::Func(f))
            })
    }

    /// A function's body after its `{`, up to the `}` that closes the function's scope.
    /// Nested braces open scopes without recursion, so nesting costs no stack.
    fn body(&mut self) -> PResult<()> {
        loop {
            let line = self.line();
            let tok = self.next()?;
            match tok {
                Tok::Punct('}') => {
                    if !self.close_scope() {
                        return Ok(());
                    }
                }
                Tok::Punct('{') => self.open_scope()?,
                Tok::Punct(';') => {}
                Tok::Directive(d) => match d {
                    ".reg" => self.reg_decl()?,
                    ".local" | ".shared" | ".param" => {
                        let VarDecl {
                            name,
                            size,
                            align,
                            init,
                            copies,
                        } = self.var_decl()?;
                        self.expect(';')?;
                        if init.is_some() {
                            return err(line, "initialised function variables are not supported");
                        }
                        let names: Vec<String> = match copies {
                            Some(n) => (0..n).map(|i| format!("{name}{i}")).collect(),
                            None => vec![name],
                        };
                        for name in names {
                            let sym = match d {
                                ".local" => {
                                    let o = align_up(self.local_bytes, align, line)?;
                                    self.local_bytes = o
                                        .checked_add(size)
                                        .filter(|&e| e <= super::MAX_LOCAL_BYTES_PER_THREAD)
                                        .ok_or((line, "local memory past the limit".to_string()))?;
                                    SymRef::Local(o)
                                }
                                ".shared" => self.shared_var(size, align, line)?,
                                _ => SymRef::FuncParam(self.fparam(size, align, line)?),
                            };
                            self.define(name, Name::Var(sym, size))?;
                        }
                    }
                    ".loc" | ".file" => self.skip_line(),
                    // The signature an indirect call names; calls copy their arguments by
                    // position, as to a direct callee.
                    ".pragma" | ".callprototype" => self.skip_statement()?,
                    _ => return err(line, format!("unsupported directive {d} in a function")),
                },
                Tok::Word(w) if self.peek() == Some(&Tok::Punct(':')) => {
                    self.bump();
                    self.spend_for_function(w.len() as u64 + MAP_ENTRY_BYTES)?;
                    self.labels.insert(w.to_string(), self.code.len() as u32);
                }
                Tok::Punct('@') => {
                    let negate = self.eat('!');
                    let pname = self.word()?;
                    let Some(Name::Reg(p)) = self.lookup(pname) else {
                        return err(line, format!("guard {pname} is not a register"));
                    };
                    let opcode = self.word()?;
                    self.instruction(opcode, Some((p, negate)), line)?;
                }
                Tok::Word(opcode) => self.instruction(opcode, None, line)?,
                t => return err(line, format!("unexpected {t:?}")),
            }
        }
    }

    fn reg_decl(&mut self) -> PResult<()> {
        let line = self.line();
        let mut width = 1u8;
        let mut tok = self.next()?;
        if let Tok::Directive(d) = &tok
            && let Some(n) = d.strip_prefix(".v").and_then(|n| n.parse().ok())
        {
            if n != 2 && n != 4 {
                return err(line, format!("vector registers of {n} elements"));
            }
            width = n;
            tok = self.next()?;
        }
        let ty = match tok {
            Tok::Directive(d) => Ty::parse(&d[1..]),
            _ => None,
        }
        .filter(|&t| width == 1 || t != Ty::Pred)
        .ok_or((
            line,
            "register declaration without a supported type".to_string(),
        ))?;
        loop {
            let name = self.word()?;
            let count = if self.eat('<') {
                let n = self.int()?;
                self.expect('>')?;
                Some(n)
            } else {
                None
            };
            let n = count.unwrap_or(1) * u64::from(width);
            if n > MAX_REGISTERS_PER_THREAD as u64
                || self.reg_bits.len() as u64 + n > MAX_REGISTERS_PER_THREAD as u64
            {
                return err(line, "too many registers");
            }
            let names: Vec<String> = match count {
                Some(n) => (0..n).map(|i| format!("{name}{i}")).collect(),
                None => vec![name.to_string()],
            };
            if self.reg_bits.len() + names.len() * usize::from(width) > MAX_REGISTERS_PER_THREAD {
                return err(line, "too many registers");
            }
            for n in names {
                if width > 1 {
                    let first = self.reg_bits.len() as u32;
                    for e in &VECTOR_ELEMENTS[..usize::from(width)] {
                        let r = self.new_register(ty)?;
                        self.define(format!("{n}.{e}"), Name::Reg(r))?;
                    }
                    self.define(n, Name::Vector(width, first))?;
                } else {
                    let r = self.new_register(ty)?;
                    self.define(n, Name::Reg(r))?;
                }
            }
            if self.eat(';') {
                return Ok(());
            }
            self.expect(',')?;
        }
    }

    fn new_register(&mut self, ty: Ty) -> PResult<u32> {
        let r = self.reg_bits.len() as u32;
        push_charged(&mut self.reg_bits, ty.bits() as u8, &mut self.meter)
            .map_err(|s| self.stopped(s))?;
        Ok(r)
    }

    /// The operand groups up to `;`, split at top-level commas.
    fn operands(&mut self) -> PResult<Vec<Vec<Tok<'a>>>> {
        let mut out: Vec<Vec<Tok<'a>>> = vec![Vec::new()];
        let mut depth = 0i32;
        let mut count = 0usize;
        loop {
            count += 1;
            if count > MAX_INSTRUCTION_TOKENS {
                return err(
                    self.line(),
                    format!("more than {MAX_INSTRUCTION_TOKENS} tokens in an instruction"),
                );
            }
            let t = self.next()?;
            match t {
                Tok::Punct(';') if depth == 0 => break,
                Tok::Punct(',') if depth == 0 => out.push(Vec::new()),
                Tok::Punct('[' | '{' | '(') => {
                    depth += 1;
                    out.last_mut().expect("group").push(t);
                }
                Tok::Punct(']' | '}' | ')') => {
                    depth -= 1;
                    out.last_mut().expect("group").push(t);
                }
                _ => out.last_mut().expect("group").push(t),
            }
            if out.len() > 16 {
                return err(self.line(), "too many operands");
            }
        }
        if out.len() == 1 && out[0].is_empty() {
            out.clear();
        }
        Ok(out)
    }

    fn instruction(&mut self, opcode: &str, guard: Option<(u32, bool)>, line: u32) -> PResult<()> {
        let mut groups = self.operands()?;
        // A vector register stands for the braced list of its elements.
        for g in &mut groups {
            if let [Tok::Word(w)] = g.as_slice()
                && let Some(Name::Vector(n, first)) = self.lookup(w)
            {
                let mut list = vec![Tok::Punct('{')];
                for i in 0..u32::from(n) {
                    if i > 0 {
                        list.push(Tok::Punct(','));
                    }
                    list.push(Tok::Reg(first + i));
                }
                list.push(Tok::Punct('}'));
                *g = list;
            }
        }
        let mut parts = opcode.split('.');
        let base = parts.next().unwrap_or_default();
        let mods: Vec<&str> = parts.collect();
        let cx = Cx { p: self, line };
        let op = match base {
            "bra" => {
                let [g] = groups.as_slice() else {
                    return err(line, "bra takes one label");
                };
                let [Tok::Word(label)] = g.as_slice() else {
                    return err(line, "bra takes a label");
                };
                let label = *label;
                self.spend_for_function(
                    label.len() as u64 + size_of::<(usize, String, u32)>() as u64,
                )?;
                self.bra_fixups
                    .push((self.code.len(), label.to_string(), line));
                Op::Bra { target: 0 }
            }
            "call" => {
                let (op, fixup) = cx.call(&groups)?;
                if let Some(name) = fixup {
                    let image = self.image_funcs.len() - 1;
                    self.spend_for_parse(
                        name.len() as u64 + size_of::<(usize, String, u32, usize)>() as u64,
                    )?;
                    self.call_fixups.push((self.code.len(), name, line, image));
                }
                op
            }
            _ => cx.decode(base, &mods, &groups)?,
        };
        self.push(Inst { guard, op, line })
    }
}

/// [`literal`], or the error of a token that is not one.
fn literal_of(t: Tok<'_>, ty: Ty, negative: bool, line: u32) -> PResult<u64> {
    literal(&t, ty, negative).ok_or((line, format!("bad literal {t:?} for .{ty:?}")))
}

/// A literal token as the raw bits of type `ty`.
fn literal(t: &Tok, ty: Ty, negative: bool) -> Option<u64> {
    let sign = |v: u64| if negative { v.wrapping_neg() } else { v };
    let fsign = |v: f64| if negative { -v } else { v };
    Some(match (t, ty) {
        (Tok::Int(v), Ty::F32) => (fsign(*v as f64) as f32).to_bits().into(),
        (Tok::Int(v), Ty::F64) => fsign(*v as f64).to_bits(),
        (Tok::Int(v), _) => sign(*v) & ty.mask().max(1),
        (Tok::F32(b), Ty::F32) => u64::from(if negative { b ^ 0x8000_0000 } else { *b }),
        (Tok::F32(b), Ty::F64) => fsign(f64::from(f32::from_bits(*b))).to_bits(),
        (Tok::F64(b), Ty::F64) => {
            if negative {
                b ^ (1 << 63)
            } else {
                *b
            }
        }
        (Tok::F64(b), Ty::F32) => u64::from((fsign(f64::from_bits(*b)) as f32).to_bits()),
        (Tok::Float(v), Ty::F32) => u64::from((fsign(*v) as f32).to_bits()),
        (Tok::Float(v), Ty::F64) => fsign(*v).to_bits(),
        (Tok::F32(b), _) => u64::from(*b),
        (Tok::F64(b), _) => *b,
        _ => return None,
    })
}

fn special(name: &str) -> Option<Sreg> {
    let dim = |s: &str| match s {
        "x" => Some(0),
        "y" => Some(1),
        "z" => Some(2),
        _ => None,
    };
    if let Some((reg, d)) = name.split_once('.') {
        let d = dim(d)?;
        return Some(match reg {
            "%tid" => Sreg::Tid(d),
            "%ntid" => Sreg::Ntid(d),
            "%ctaid" => Sreg::Ctaid(d),
            "%nctaid" => Sreg::Nctaid(d),
            _ => return None,
        });
    }
    Some(match name {
        "%laneid" => Sreg::LaneId,
        "%warpid" => Sreg::WarpId,
        "%nwarpid" => Sreg::NWarpId,
        "%smid" => Sreg::SmId,
        "%nsmid" => Sreg::NSmId,
        "%gridid" => Sreg::GridId,
        "%clock" => Sreg::Clock,
        "%clock64" => Sreg::Clock64,
        "%globaltimer" => Sreg::GlobalTimer,
        "%lanemask_eq" => Sreg::LaneMaskEq,
        "%lanemask_lt" => Sreg::LaneMaskLt,
        "%lanemask_le" => Sreg::LaneMaskLe,
        "%lanemask_gt" => Sreg::LaneMaskGt,
        "%lanemask_ge" => Sreg::LaneMaskGe,
        "%dynamic_smem_size" => Sreg::DynamicSmemSize,
        "%total_smem_size" => Sreg::TotalSmemSize,
        "WARP_SZ" => return None,
        _ => {
            // `%envreg0` to `%envreg31`, without leading zeros.
            let digits = name.strip_prefix("%envreg")?;
            let canonical = digits.bytes().all(|b| b.is_ascii_digit())
                && (digits == "0" || !digits.starts_with('0'));
            let n: u8 = digits.parse().ok().filter(|&n| canonical && n < 32)?;
            return Some(Sreg::EnvReg(n));
        }
    })
}

/// Operand decoding for one instruction.
struct Cx<'a> {
    p: &'a Parser<'a>,
    line: u32,
}

fn space_of(mods: &[&str]) -> Space {
    for m in mods {
        match *m {
            "global" => return Space::Global,
            "const" => return Space::Const,
            "shared" => return Space::Shared,
            "local" => return Space::Local,
            "param" => return Space::Param,
            _ => {}
        }
    }
    Space::Generic
}

fn rnd_of(mods: &[&str]) -> Rnd {
    for m in mods {
        match *m {
            "rz" => return Rnd::Rz,
            "rm" => return Rnd::Rm,
            "rp" => return Rnd::Rp,
            _ => {}
        }
    }
    Rnd::Rn
}

fn has(mods: &[&str], m: &str) -> bool {
    mods.contains(&m)
}

/// Integer types of the arithmetic instructions (`add`, `mul`, `min`, ...).
const INTS: &[&str] = &["u16", "u32", "u64", "s16", "s32", "s64"];
/// Untyped bit types of the logical instructions.
const BITS: &[&str] = &["b16", "b32", "b64"];
/// Every register type a move, load or comparison may name.
const ALL: &[&str] = &[
    "b8", "b16", "b32", "b64", "u8", "u16", "u32", "u64", "s8", "s16", "s32", "s64", "f32", "f64",
];
/// Half-precision arithmetic types (registers are .b16 and .b32).
const HALF: &[&str] = &["f16", "f16x2"];
/// Half-precision forms that need a later GPU than sm_75, with the target that has them:
/// they are refused by name rather than as unknown.
const PAST_SM75: &[(&str, &str)] = &[
    ("bf16", "sm_80"),
    ("bf16x2", "sm_80"),
    ("relu", "sm_80"),
    ("f16x2.f32", "sm_80"),
];
/// Nearest and directed rounding of a floating-point result.
const RND: &[&str] = &["rn", "rz", "rm", "rp"];
/// Integer rounding of `cvt`.
const IRND: &[&str] = &["rni", "rzi", "rmi", "rpi"];
/// Memory-ordering and scope qualifiers: the interpreter runs every access in program order
/// on one coherent memory, which is at least as strong as each of them.
const ORDER: &[&str] = &[
    "volatile", "relaxed", "acquire", "release", "acq_rel", "weak", "cta", "gpu", "sys",
];
/// Cache operators: where data is kept, with no effect on values in this model (`.nc`
/// promises no writes during the kernel; one anyway still reads back).
const CACHE: &[&str] = &["ca", "cg", "cs", "lu", "cv", "wb", "wt", "nc"];
/// State spaces of loads and stores.
const SPACES: &[&str] = &["global", "const", "shared", "local", "param"];
/// `setp`'s comparisons.
const CMPS: &[&str] = &[
    "eq", "ne", "lt", "le", "gt", "ge", "lo", "ls", "hi", "hs", "equ", "neu", "ltu", "leu", "gtu",
    "geu", "num", "nan",
];

/// The modifiers (types included) each instruction is implemented with: [`Cx::accepts`]
/// refuses anything else at load, so no modifier is ever ignored. Instructions that check
/// their own combinations (textures, surfaces, video) are not listed.
fn allowed(base: &str) -> Option<Vec<&'static [&'static str]>> {
    Some(match base {
        "mov" => vec![ALL, &["pred", "v2", "v4"]],
        "ld" | "st" => vec![ALL, ORDER, CACHE, SPACES, &["v2", "v4"]],
        "ldu" => vec![ALL, &["global", "v2", "v4"]],
        "cvta" => vec![&["to", "global", "const", "shared", "local", "u32", "u64"]],
        "add" | "sub" => vec![INTS, RND, HALF, &["f32", "f64", "sat", "ftz", "cc"]],
        "addc" | "subc" => vec![&["u32", "s32", "u64", "s64", "cc"]],
        "madc" => vec![&["u32", "s32", "u64", "s64", "hi", "lo", "cc"]],
        "mul" => vec![
            INTS,
            RND,
            HALF,
            &["f32", "f64", "hi", "lo", "wide", "sat", "ftz"],
        ],
        "div" => vec![INTS, RND, &["f32", "f64", "approx", "full", "ftz"]],
        "rem" => vec![INTS],
        "and" | "or" | "xor" | "not" | "cnot" => vec![BITS, &["pred"]],
        "shl" => vec![BITS],
        "shr" => vec![BITS, INTS],
        "min" | "max" => vec![INTS, &["f32", "f64", "ftz"]],
        "copysign" => vec![&["f32", "f64"]],
        "neg" | "abs" => vec![HALF, &["s16", "s32", "s64", "f32", "f64", "ftz"]],
        "popc" | "clz" | "brev" => vec![&["b32", "b64"]],
        "rcp" | "sqrt" => vec![RND, &["f32", "f64", "approx", "ftz"]],
        "rsqrt" => vec![&["f32", "f64", "approx", "ftz"]],
        "sin" | "cos" | "lg2" | "ex2" => vec![&["f32", "approx", "ftz"]],
        "mad" => vec![
            INTS,
            RND,
            &["f32", "f64", "hi", "lo", "wide", "sat", "ftz", "cc"],
        ],
        "fma" => vec![RND, HALF, &["f32", "f64", "sat", "ftz"]],
        "mul24" | "mad24" => vec![&["u32", "s32", "lo", "hi", "sat"]],
        "sad" => vec![INTS],
        "setp" => vec![ALL, CMPS, &["f16", "and", "or", "xor", "ftz"]],
        "set" => vec![ALL, CMPS, &["and", "or", "xor", "ftz"]],
        "selp" => vec![ALL],
        "slct" => vec![ALL, &["ftz"]],
        "isspacep" => vec![&["global", "shared", "local"]],
        "cvt" => vec![ALL, RND, IRND, &["f16", "sat", "ftz"]],
        "bfe" => vec![&["u32", "u64", "s32", "s64"]],
        "bfi" => vec![&["b32", "b64"]],
        "prmt" => vec![&["b32", "f4e", "b4e", "rc8", "ecl", "ecr", "rc16"]],
        "lop3" => vec![&["b32"]],
        "shf" => vec![&["l", "r", "clamp", "wrap", "b32"]],
        "bfind" => vec![&["u32", "s32", "u64", "s64", "shiftamt"]],
        "bmsk" => vec![&["clamp", "wrap", "b32"]],
        "testp" => vec![&[
            "finite",
            "infinite",
            "number",
            "notanumber",
            "normal",
            "subnormal",
            "f32",
            "f64",
        ]],
        "dp4a" | "dp2a" => vec![&["u32", "s32", "lo", "hi"]],
        "ret" | "exit" => vec![&["uni"]],
        "bar" | "barrier" => vec![&[
            "sync", "arrive", "warp", "aligned", "cta", "red", "popc", "and", "or", "u32", "pred",
        ]],
        "membar" => vec![&["cta", "gl", "sys"]],
        "fence" => vec![&["sc", "acq_rel", "cta", "gpu", "sys"]],
        "prefetch" => vec![&["global", "local", "L1", "L2"]],
        "prefetchu" => vec![&["L1"]],
        "nanosleep" => vec![&["u32"]],
        "atom" | "red" => vec![
            ORDER,
            &[
                "global", "shared", "add", "min", "max", "inc", "dec", "and", "or", "xor", "exch",
                "cas", "b32", "b64", "u32", "s32", "u64", "s64", "f32", "f64",
            ],
        ],
        "shfl" => vec![&["sync", "up", "down", "bfly", "idx", "b32"]],
        "vote" => vec![&["sync", "all", "any", "uni", "ballot", "pred", "b32"]],
        "activemask" => vec![&["b32"]],
        "match" => vec![&["any", "all", "sync", "b32", "b64"]],
        "trap" | "brkpt" | "pmevent" => vec![],
        _ => return None,
    })
}

impl Cx<'_> {
    fn fail<T>(&self, msg: impl Into<String>) -> PResult<T> {
        err(self.line, msg)
    }

    /// Refuses the half-precision forms sm_75 lacks, naming the target that has them, and
    /// the ones that exist nowhere (rounding other than `.rn` on arithmetic, `mad`, `div`).
    fn half(&self, base: &str, mods: &[&str]) -> PResult<()> {
        let joined = mods.join(".");
        if let Some((m, target)) = PAST_SM75
            .iter()
            .find(|(m, _)| mods.contains(m) || m.contains('.') && joined.contains(m))
        {
            return self.fail(format!(
                "{base}.{m} needs {target} or later; this device is sm_75"
            ));
        }
        if !mods.iter().any(|m| HALF.contains(m)) {
            return Ok(());
        }
        if matches!(base, "min" | "max") {
            return self.fail(format!(
                "{base}.f16 needs sm_80 or later; this device is sm_75"
            ));
        }
        let rounded = mods.iter().find(|m| RND.contains(m) && **m != "rn");
        if let (Some(r), "add" | "sub" | "mul" | "fma") = (rounded, base) {
            return self.fail(format!("{base}.{r} on half precision does not exist"));
        }
        if base == "fma" && !has(mods, "rn") {
            return self.fail("fma on half precision needs .rn");
        }
        if base == "setp" && has(mods, "f16x2") {
            return self.fail("setp.f16x2 is not supported");
        }
        Ok(())
    }

    /// Refuses a modifier `base` is not implemented with (see [`allowed`]), naming it.
    fn accepts(&self, base: &str, mods: &[&str]) -> PResult<()> {
        let Some(sets) = allowed(base) else {
            return Ok(());
        };
        match mods
            .iter()
            .find(|m| !sets.iter().any(|set| set.contains(m)))
        {
            Some(m) => self.fail(format!("{base}.{m} is not supported")),
            None => Ok(()),
        }
    }

    fn name(&self, n: &str) -> PResult<Name> {
        self.p
            .lookup(n)
            .ok_or((self.line, format!("undefined name {n}")))
    }

    fn ty(&self, mods: &[&str]) -> PResult<Ty> {
        mods.iter()
            .rev()
            .find_map(|m| Ty::parse(m))
            .ok_or((self.line, "instruction without a type".to_string()))
    }

    fn reg(&self, g: &[Tok]) -> PResult<u32> {
        match g {
            [Tok::Reg(r)] => Ok(*r),
            [Tok::Word(w)] => match self.name(w)? {
                Name::Reg(r) => Ok(r),
                _ => self.fail(format!("{w} is not a register")),
            },
            _ => self.fail(format!("expected a register, found {g:?}")),
        }
    }

    /// A destination: a register or the sink `_`.
    fn dst(&self, g: &[Tok]) -> PResult<u32> {
        match g {
            [Tok::Word(w)] if *w == "_" => Ok(SINK),
            _ => self.reg(g),
        }
    }

    fn src(&self, g: &[Tok], ty: Ty) -> PResult<Src> {
        let imm = match g {
            [Tok::Reg(r)] => return Ok(Src::Reg(*r)),
            [Tok::Word(w)] => {
                if let Some(s) = special(w) {
                    return Ok(Src::Special(s));
                }
                if *w == "WARP_SZ" {
                    return Ok(Src::Imm(32));
                }
                return match self.name(w)? {
                    Name::Reg(r) => Ok(Src::Reg(r)),
                    Name::Var(SymRef::KernelParam(o), _) => {
                        Ok(Src::Imm(KPARAM_WINDOW + u64::from(o)))
                    }
                    Name::Var(SymRef::FuncParam(_), _) => {
                        self.fail(format!("the address of parameter {w} is not supported"))
                    }
                    Name::Var(sym, _) => Ok(Src::Sym(sym, 0)),
                    Name::Func(f) => Ok(Src::Imm(func_address(f))),
                    Name::Vector(..) => self.fail(format!("vector register {w} as a scalar")),
                };
            }
            [Tok::Punct('-'), t] => literal(t, ty, true),
            [t] => literal(t, ty, false),
            // `var + 8`, `var - 8`: an address plus an offset.
            [Tok::Word(w), Tok::Punct(sign @ ('+' | '-')), Tok::Int(v)] => {
                let Name::Var(sym, _) = self.name(w)? else {
                    return self.fail(format!("{w} + offset: {w} is not a variable"));
                };
                if matches!(sym, SymRef::FuncParam(_)) {
                    return self.fail(format!("the address of parameter {w} is not supported"));
                }
                let v =
                    i64::try_from(*v).map_err(|_| (self.line, "offset too large".to_string()))?;
                if let SymRef::KernelParam(o) = sym {
                    let base = KPARAM_WINDOW + u64::from(o);
                    return Ok(Src::Imm(if *sign == '-' {
                        base.wrapping_sub(v as u64)
                    } else {
                        base.wrapping_add(v as u64)
                    }));
                }
                return Ok(Src::Sym(sym, if *sign == '-' { -v } else { v }));
            }
            _ => None,
        };
        imm.map(Src::Imm)
            .ok_or((self.line, format!("bad operand {g:?}")))
    }

    fn addr(&self, g: &[Tok]) -> PResult<Addr> {
        let inner = match g {
            [Tok::Punct('['), inner @ .., Tok::Punct(']')] => inner,
            _ => return self.fail(format!("expected an address, found {g:?}")),
        };
        let (base, rest) = match inner {
            [Tok::Word(w), rest @ ..] => {
                let base = match self.name(w)? {
                    Name::Reg(r) => AddrBase::Reg(r),
                    Name::Var(sym, _) => AddrBase::Sym(sym),
                    _ => return self.fail(format!("{w} is not an address")),
                };
                (base, rest)
            }
            _ => (AddrBase::Abs, inner),
        };
        let offset: i64 = match rest {
            [] => 0,
            [Tok::Int(v)] if base == AddrBase::Abs => i64::try_from(*v).unwrap_or(i64::MAX),
            [Tok::Punct('+'), Tok::Int(v)] => i64::try_from(*v).unwrap_or(i64::MAX),
            [Tok::Punct('+'), Tok::Punct('-'), Tok::Int(v)] | [Tok::Punct('-'), Tok::Int(v)] => {
                -(i64::try_from(*v).unwrap_or(i64::MAX))
            }
            _ => return self.fail(format!("bad address {g:?}")),
        };
        Ok(Addr { base, offset })
    }

    /// `{a, b, ...}` groups, split at commas.
    fn vector<'g, 't>(&self, g: &'g [Tok<'t>]) -> PResult<Vec<&'g [Tok<'t>]>> {
        let [Tok::Punct('{'), inner @ .., Tok::Punct('}')] = g else {
            return self.fail("expected a vector");
        };
        Ok(inner.split(|t| *t == Tok::Punct(',')).collect())
    }

    fn is_vector(g: &[Tok]) -> bool {
        g.first() == Some(&Tok::Punct('{'))
    }

    fn n_ops<'g, 't>(&self, groups: &'g [Vec<Tok<'t>>], n: usize) -> PResult<&'g [Vec<Tok<'t>>]> {
        if groups.len() == n {
            Ok(groups)
        } else {
            self.fail(format!("expected {n} operands, found {}", groups.len()))
        }
    }

    /// `call [(ret),] target [, (args)] [, prototype]`: the target a function name, or a
    /// register holding a function's address (an indirect call, which names a prototype).
    fn call(&self, groups: &[Vec<Tok>]) -> PResult<(Op, Option<String>)> {
        let param = |g: &[Tok]| -> PResult<(u32, u32)> {
            match g {
                [Tok::Word(w)] => match self.name(w)? {
                    Name::Var(SymRef::FuncParam(o), size) => Ok((o, size)),
                    _ => self.fail(format!("{w} is not a .param variable")),
                },
                _ => self.fail(format!("bad call parameter {g:?}")),
            }
        };
        let is_paren = |g: &[Tok]| g.first() == Some(&Tok::Punct('('));
        let paren = |g: &[Tok]| -> PResult<Vec<(u32, u32)>> {
            let [Tok::Punct('('), inner @ .., Tok::Punct(')')] = g else {
                return self.fail("expected a parenthesised list");
            };
            if inner.is_empty() {
                return Ok(Vec::new());
            }
            inner.split(|t| *t == Tok::Punct(',')).map(param).collect()
        };
        let mut rest = groups;
        let ret = match rest {
            [r, tail @ ..] if is_paren(r) => {
                rest = tail;
                let r = paren(r)?;
                if r.len() > 1 {
                    return self.fail("more than one return value");
                }
                r.first().copied()
            }
            _ => None,
        };
        let [target, tail @ ..] = rest else {
            return self.fail("bad call");
        };
        let args = match tail {
            [a, ..] if is_paren(a) => paren(a)?,
            _ => Vec::new(),
        };
        let extra = tail.len() - usize::from(tail.first().is_some_and(|a| is_paren(a)));
        let [Tok::Word(name)] = target.as_slice() else {
            return self.fail("bad call target");
        };
        let callee = match self.p.lookup(name) {
            Some(Name::Reg(r)) => {
                if extra != 1 {
                    return self.fail("an indirect call names a prototype");
                }
                Callee::Indirect(r)
            }
            _ if extra != 0 => return self.fail("bad call"),
            _ if *name == "vprintf" => {
                if args.len() != 2 {
                    return self.fail("vprintf takes two arguments");
                }
                Callee::Vprintf
            }
            Some(Name::Func(_)) | None => {
                let op = Op::Call {
                    callee: Callee::Func(u32::MAX),
                    ret,
                    args,
                };
                return Ok((op, Some(name.to_string())));
            }
            Some(_) => return self.fail(format!("{name} is not a function")),
        };
        Ok((Op::Call { callee, ret, args }, None))
    }

    fn decode(&self, base: &str, mods: &[&str], g: &[Vec<Tok>]) -> PResult<Op> {
        self.half(base, mods)?;
        self.accepts(base, mods)?;
        let ftz = has(mods, "ftz");
        let sat = has(mods, "sat");
        if let Some(t) = mods.iter().rev().find_map(|m| Ty::parse(m))
            && base != "cvt"
        {
            let rounded = mods.iter().any(|m| RND.contains(m));
            if !t.float() && (ftz || rounded || has(mods, "approx") || has(mods, "full")) {
                return self.fail(format!(
                    "{base} with rounding or .ftz on .{t:?} does not exist"
                ));
            }
            if t == Ty::F64 && ftz && !(has(mods, "approx") && matches!(base, "rcp" | "rsqrt")) {
                return self.fail(format!("{base}.ftz.f64 does not exist"));
            }
        }
        Ok(match base {
            "mov" if has(mods, "v2") || has(mods, "v4") => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 2)?;
                let (ds, ss) = (self.vector(&g[0])?, self.vector(&g[1])?);
                let n = if has(mods, "v4") { 4 } else { 2 };
                if ds.len() != n || ss.len() != n {
                    return self.fail("vector width and operand count differ");
                }
                let mut d = [SINK; 4];
                let mut srcs = [Src::Imm(0); 4];
                for i in 0..n {
                    d[i] = self.dst(ds[i])?;
                    srcs[i] = self.src(ss[i], ty)?;
                }
                Op::MovVec {
                    ty,
                    n: n as u8,
                    ds: d,
                    srcs,
                }
            }
            "vadd" | "vsub" | "vabsdiff" | "vmin" | "vmax" => {
                let types: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
                let [dty, aty, bty] = types[..] else {
                    return self.fail("a video instruction names three types");
                };
                if [dty, aty, bty]
                    .iter()
                    .any(|t| !matches!(t, Ty::U32 | Ty::S32))
                {
                    return self.fail("only 32-bit scalar video instructions are supported");
                }
                let sec = mods.iter().find_map(|m| match *m {
                    "add" => Some(BinOp::Add),
                    "min" => Some(BinOp::Min),
                    "max" => Some(BinOp::Max),
                    _ => None,
                });
                let g = self.n_ops(g, if sec.is_some() { 4 } else { 3 })?;
                Op::Video {
                    op: match base {
                        "vadd" => VideoOp::Add,
                        "vsub" => VideoOp::Sub,
                        "vabsdiff" => VideoOp::AbsDiff,
                        "vmin" => VideoOp::Min,
                        _ => VideoOp::Max,
                    },
                    signed: [dty.signed(), aty.signed(), bty.signed()],
                    sat: has(mods, "sat"),
                    sec,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], aty)?,
                    b: self.src(&g[2], bty)?,
                    c: match g.get(3) {
                        Some(c) => self.src(c, dty)?,
                        None => Src::Imm(0),
                    },
                }
            }
            "mov" => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 2)?;
                let parts_ok =
                    |n: usize| matches!((ty.bits(), n), (64, 2 | 4 | 8) | (32, 2 | 4) | (16, 2));
                if Self::is_vector(&g[0]) {
                    let ds = self.vector(&g[0])?;
                    if !parts_ok(ds.len()) {
                        return self.fail("bad vector mov");
                    }
                    let ds: Vec<u32> = ds.iter().map(|d| self.dst(d)).collect::<PResult<_>>()?;
                    let part_bits = ty.bits() / ds.len() as u32;
                    Op::Unpack {
                        part_bits,
                        ds,
                        a: self.src(&g[1], ty)?,
                    }
                } else if Self::is_vector(&g[1]) {
                    let parts = self.vector(&g[1])?;
                    if !parts_ok(parts.len()) {
                        return self.fail("bad vector mov");
                    }
                    let part_bits = ty.bits() / parts.len() as u32;
                    let pty = match part_bits {
                        8 => Ty::B8,
                        16 => Ty::B16,
                        32 => Ty::B32,
                        _ => return self.fail("bad vector mov"),
                    };
                    let parts = parts
                        .iter()
                        .map(|p| self.src(p, pty))
                        .collect::<PResult<_>>()?;
                    Op::Pack {
                        part_bits,
                        d: self.reg(&g[0])?,
                        parts,
                    }
                } else {
                    Op::Mov {
                        ty,
                        d: self.reg(&g[0])?,
                        a: self.src(&g[1], ty)?,
                    }
                }
            }
            "ld" | "ldu" | "st" => {
                let ty = self.ty(mods)?;
                if ty == Ty::Pred {
                    return self.fail("predicate loads and stores do not exist");
                }
                let n: u8 = if has(mods, "v4") {
                    4
                } else if has(mods, "v2") {
                    2
                } else {
                    1
                };
                if has(mods, "v8") {
                    return self.fail(".v8 accesses are not supported");
                }
                let space = space_of(mods);
                let g = self.n_ops(g, 2)?;
                let (addr_g, val_g) = if base == "st" {
                    (&g[0], &g[1])
                } else {
                    (&g[1], &g[0])
                };
                let addr = self.addr(addr_g)?;
                // A parameter by name, or through a register holding a kernel parameter's
                // address (its window; anything else is the function-parameter scratch).
                if space == Space::Param && matches!(addr.base, AddrBase::Abs) {
                    return self.fail("ld/st.param must name a parameter");
                }
                let vals: Vec<&[Tok]> = if n > 1 {
                    let v = self.vector(val_g)?;
                    if v.len() != usize::from(n) {
                        return self.fail("vector width and operand count differ");
                    }
                    v
                } else {
                    vec![val_g.as_slice()]
                };
                if base == "st" {
                    let mut srcs = [Src::Imm(0); 4];
                    for (s, v) in srcs.iter_mut().zip(&vals) {
                        *s = self.src(v, ty)?;
                    }
                    Op::St {
                        space,
                        ty,
                        n,
                        srcs,
                        addr,
                    }
                } else {
                    let mut ds = [SINK; 4];
                    for (d, v) in ds.iter_mut().zip(&vals) {
                        *d = self.dst(v)?;
                    }
                    Op::Ld {
                        space,
                        ty,
                        n,
                        ds,
                        addr,
                    }
                }
            }
            "cvta" => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 2)?;
                let space = space_of(mods);
                if matches!(space, Space::Generic | Space::Param) {
                    return self.fail("cvta of this space is not supported");
                }
                Op::Cvta {
                    to: has(mods, "to"),
                    space,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], ty)?,
                }
            }
            "addc" | "subc" | "madc" => self.carry(base, mods, g)?,
            "add" | "sub" | "mad" if has(mods, "cc") => self.carry(base, mods, g)?,
            "add" | "sub" | "mul" | "div" | "rem" | "and" | "or" | "xor" | "shl" | "shr"
            | "min" | "max" | "copysign" => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 3)?;
                let op = match base {
                    "add" => BinOp::Add,
                    "sub" => BinOp::Sub,
                    "mul" if has(mods, "hi") => BinOp::MulHi,
                    "mul" if has(mods, "wide") => BinOp::MulWide,
                    "mul" => BinOp::MulLo,
                    "div" => BinOp::Div,
                    "rem" => BinOp::Rem,
                    "and" => BinOp::And,
                    "or" => BinOp::Or,
                    "xor" => BinOp::Xor,
                    "shl" => BinOp::Shl,
                    "shr" => BinOp::Shr,
                    "min" => BinOp::Min,
                    "max" => BinOp::Max,
                    _ => BinOp::CopySign,
                };
                let bty = if matches!(op, BinOp::Shl | BinOp::Shr) {
                    Ty::U32
                } else {
                    ty
                };
                if ty.float() && matches!(op, BinOp::MulHi | BinOp::MulWide | BinOp::Rem) {
                    return self.fail("integer-only operation on a float type");
                }
                if sat
                    && !(matches!(op, BinOp::Add | BinOp::Sub | BinOp::MulLo)
                        && (ty == Ty::F32 || ty.half())
                        || matches!(op, BinOp::Add | BinOp::Sub) && ty == Ty::S32)
                {
                    return self.fail(format!("{base}.sat on .{ty:?} is not supported"));
                }
                if ty.float()
                    && !matches!(op, BinOp::Add | BinOp::Sub | BinOp::MulLo | BinOp::Div)
                    && mods.iter().any(|m| RND.contains(m))
                {
                    return self.fail(format!("{base} with a rounding modifier does not exist"));
                }
                Op::Bin {
                    op,
                    ty,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], ty)?,
                    b: self.src(&g[2], bty)?,
                    ftz,
                    sat,
                    rnd: rnd_of(mods),
                }
            }
            "neg" | "abs" | "not" | "cnot" | "popc" | "clz" | "brev" | "rcp" | "sqrt" | "rsqrt"
            | "sin" | "cos" | "ex2" | "lg2" => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 2)?;
                let op = match base {
                    "neg" => UnOp::Neg,
                    "abs" => UnOp::Abs,
                    "not" => UnOp::Not,
                    "cnot" => UnOp::CNot,
                    "popc" => UnOp::Popc,
                    "clz" => UnOp::Clz,
                    "brev" => UnOp::Brev,
                    "rcp" => UnOp::Rcp,
                    "sqrt" => UnOp::Sqrt,
                    "rsqrt" => UnOp::Rsqrt,
                    "sin" => UnOp::Sin,
                    "cos" => UnOp::Cos,
                    "ex2" => UnOp::Ex2,
                    _ => UnOp::Lg2,
                };
                let float_only = matches!(
                    op,
                    UnOp::Rcp
                        | UnOp::Sqrt
                        | UnOp::Rsqrt
                        | UnOp::Sin
                        | UnOp::Cos
                        | UnOp::Ex2
                        | UnOp::Lg2
                );
                if float_only != ty.float() && !matches!(op, UnOp::Neg | UnOp::Abs) {
                    return self.fail(format!("{base} on .{ty:?} is not supported"));
                }
                let rnd = rnd_of(mods);
                let rounded = mods.iter().any(|m| RND.contains(m));
                if rounded && has(mods, "approx") {
                    return self.fail(format!(
                        "{base}.approx with a rounding modifier does not exist"
                    ));
                }
                Op::Un {
                    op,
                    ty,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], ty)?,
                    ftz,
                    rnd,
                }
            }
            "mul24" | "mad24" | "sad" => {
                let ty = self.ty(mods)?;
                let mode = match base {
                    "sad" => MadMode::Sad,
                    _ if has(mods, "hi") => MadMode::Hi24,
                    _ if has(mods, "lo") => MadMode::Lo24,
                    _ => return self.fail(format!("{base} needs .lo or .hi")),
                };
                if sat && !(base == "mad24" && mode == MadMode::Hi24 && ty == Ty::S32) {
                    return self.fail(format!("{base}.sat exists only as mad24.hi.sat.s32"));
                }
                let g = self.n_ops(g, if base == "mul24" { 3 } else { 4 })?;
                Op::Mad {
                    mode,
                    ty,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], ty)?,
                    b: self.src(&g[2], ty)?,
                    c: match g.get(3) {
                        Some(c) => self.src(c, ty)?,
                        None => Src::Imm(0),
                    },
                    ftz,
                    sat,
                    rnd: Rnd::Rn,
                }
            }
            "mad" | "fma" => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 4)?;
                let mode = if ty.float() {
                    MadMode::Float
                } else if has(mods, "hi") {
                    MadMode::Hi
                } else if has(mods, "wide") {
                    MadMode::Wide
                } else if has(mods, "lo") {
                    MadMode::Lo
                } else {
                    return self.fail("integer mad needs .lo, .hi or .wide");
                };
                let rnd = rnd_of(mods);
                if ty == Ty::F64 && rnd != Rnd::Rn {
                    return self.fail(format!(
                        "{base}.f64 with directed rounding is not supported"
                    ));
                }
                if sat && !(ty == Ty::F32 || ty.half() || ty == Ty::S32 && mode != MadMode::Wide) {
                    return self.fail(format!("{base}.sat on .{ty:?} is not supported"));
                }
                let cty = if mode == MadMode::Wide { wide(ty) } else { ty };
                Op::Mad {
                    mode,
                    ty,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], ty)?,
                    b: self.src(&g[2], ty)?,
                    c: self.src(&g[3], cty)?,
                    ftz,
                    sat,
                    rnd,
                }
            }
            "setp" | "set" => {
                let ty = self.ty(mods)?;
                let to = match mods.iter().find_map(|m| Ty::parse(m)) {
                    _ if base == "setp" => CmpResult::Pred,
                    Some(Ty::U32 | Ty::S32) => CmpResult::Mask,
                    Some(Ty::F32) => CmpResult::One,
                    _ => return self.fail("set writes .u32, .s32 or .f32"),
                };
                if base == "set" && mods.iter().filter(|m| Ty::parse(m).is_some()).count() != 2 {
                    return self.fail("set names a result and a source type");
                }
                let cmp = mods
                    .iter()
                    .find_map(|m| cmp_of(m))
                    .ok_or((self.line, "setp without a comparison".to_string()))?;
                let combine_op = mods.iter().find_map(|m| match *m {
                    "and" => Some(BoolOp::And),
                    "or" => Some(BoolOp::Or),
                    "xor" => Some(BoolOp::Xor),
                    _ => None,
                });
                if g.len() != 3 && g.len() != 4 {
                    return self.fail("setp takes 3 or 4 operands");
                }
                let (p, q) = match g[0].as_slice() {
                    [a, Tok::Punct('|'), b] => (
                        self.dst(std::slice::from_ref(a))?,
                        self.dst(std::slice::from_ref(b))?,
                    ),
                    d => (self.dst(d)?, SINK),
                };
                if base == "set" && q != SINK {
                    return self.fail("set has one destination");
                }
                let combine = match (combine_op, g.get(3)) {
                    (Some(op), Some(c)) => {
                        let (neg, c) = match c.as_slice() {
                            [Tok::Punct('!'), rest @ ..] => (true, rest),
                            c => (false, c),
                        };
                        Some((op, self.src(c, Ty::Pred)?, neg))
                    }
                    (None, None) => None,
                    _ => return self.fail("setp boolean operation and operand must come together"),
                };
                Op::Setp {
                    cmp,
                    ty,
                    to,
                    p,
                    q,
                    a: self.src(&g[1], ty)?,
                    b: self.src(&g[2], ty)?,
                    combine,
                    ftz,
                }
            }
            "isspacep" => {
                let g = self.n_ops(g, 2)?;
                let space = space_of(mods);
                if space == Space::Generic {
                    return self.fail("isspacep names a state space");
                }
                Op::IsSpace {
                    space,
                    p: self.dst(&g[0])?,
                    a: self.src(&g[1], Ty::U64)?,
                }
            }
            "slct" => {
                let tys: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
                let [ty, cty] = tys[..] else {
                    return self.fail("slct names a result and a selector type");
                };
                if !matches!(cty, Ty::S32 | Ty::F32) || ty.bits() < 16 {
                    return self.fail(format!("slct.{ty:?}.{cty:?} does not exist"));
                }
                let g = self.n_ops(g, 4)?;
                Op::Slct {
                    float: cty == Ty::F32,
                    ftz,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], ty)?,
                    b: self.src(&g[2], ty)?,
                    c: self.src(&g[3], cty)?,
                }
            }
            "selp" => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 4)?;
                Op::Selp {
                    ty,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], ty)?,
                    b: self.src(&g[2], ty)?,
                    c: self.src(&g[3], Ty::Pred)?,
                }
            }
            "cvt" => {
                let tys: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
                let [dty, sty] = tys.as_slice() else {
                    return self.fail("cvt needs a destination and a source type");
                };
                let g = self.n_ops(g, 2)?;
                let irnd = mods.iter().find_map(|m| match *m {
                    "rni" => Some(IRnd::Rni),
                    "rzi" => Some(IRnd::Rzi),
                    "rmi" => Some(IRnd::Rmi),
                    "rpi" => Some(IRnd::Rpi),
                    _ => None,
                });
                let rnd = mods
                    .iter()
                    .any(|m| matches!(*m, "rn" | "rz" | "rm" | "rp"))
                    .then(|| rnd_of(mods));
                if matches!((dty, sty), (Ty::Pred, _) | (_, Ty::Pred)) {
                    return self.fail("cvt of predicates does not exist");
                }
                let (df, sf) = (dty.float(), sty.float());
                if irnd.is_some() && !sf || rnd.is_some() && !df || irnd.is_some() && rnd.is_some()
                {
                    return self.fail("cvt with a rounding modifier its types do not take");
                }
                if sf && !df && irnd.is_none()
                    || df && sf && dty.bits() < sty.bits() && rnd.is_none()
                {
                    return self.fail("cvt that rounds needs a rounding modifier");
                }
                if ftz && !(*dty == Ty::F32 || *sty == Ty::F32) {
                    return self.fail("cvt.ftz without an f32 operand does not exist");
                }
                Op::Cvt {
                    dty: *dty,
                    sty: *sty,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], *sty)?,
                    rnd,
                    irnd,
                    sat,
                    ftz,
                }
            }
            "bfe" => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 4)?;
                Op::Bfe {
                    ty,
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], ty)?,
                    b: self.src(&g[2], Ty::U32)?,
                    c: self.src(&g[3], Ty::U32)?,
                }
            }
            "bfi" => {
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 5)?;
                Op::Bfi {
                    ty,
                    d: self.reg(&g[0])?,
                    f: self.src(&g[1], ty)?,
                    b: self.src(&g[2], ty)?,
                    c: self.src(&g[3], Ty::U32)?,
                    e: self.src(&g[4], Ty::U32)?,
                }
            }
            "prmt" | "lop3" | "shf" | "bfind" | "bmsk" | "testp" | "dp4a" | "dp2a"
                if base != "prmt" || mods.len() > 1 =>
            {
                self.bits(base, mods, g)?
            }
            "prmt" => {
                let g = self.n_ops(g, 4)?;
                Op::Prmt {
                    d: self.reg(&g[0])?,
                    a: self.src(&g[1], Ty::B32)?,
                    b: self.src(&g[2], Ty::B32)?,
                    c: self.src(&g[3], Ty::B32)?,
                }
            }
            "ret" => Op::Ret,
            "exit" => Op::Exit,
            "bar" | "barrier" if has(mods, "warp") => Op::WarpSync {
                mask: match g {
                    [m] => self.src(m, Ty::B32)?,
                    _ => return self.fail("bar.warp.sync takes a member mask"),
                },
            },
            "bar" | "barrier" if has(mods, "red") => {
                let op = match (has(mods, "popc"), has(mods, "and"), has(mods, "or")) {
                    (true, false, false) if has(mods, "u32") => BarRedOp::Popc,
                    (false, true, false) if has(mods, "pred") => BarRedOp::And,
                    (false, false, true) if has(mods, "pred") => BarRedOp::Or,
                    _ => return self.fail("bar.red is .popc.u32, .and.pred or .or.pred"),
                };
                let (d, rest) = g
                    .split_first()
                    .ok_or((self.line, "bar.red needs operands".to_string()))?;
                let (id, count, p) = match rest {
                    [a, p] => (self.src(a, Ty::U32)?, None, p),
                    [a, b, p] => (self.src(a, Ty::U32)?, Some(self.src(b, Ty::U32)?), p),
                    _ => return self.fail("bar.red takes a barrier, a count and a predicate"),
                };
                let (negate, p) = match p.as_slice() {
                    [Tok::Punct('!'), rest @ ..] => (true, rest),
                    p => (false, p),
                };
                Op::BarRed {
                    op,
                    d: self.reg(d)?,
                    id,
                    count,
                    p: self.src(p, Ty::Pred)?,
                    negate,
                }
            }
            "bar" | "barrier" => {
                if has(mods, "popc") || has(mods, "and") || has(mods, "or") {
                    return self.fail("a reduction needs bar.red");
                }
                let (id, count) = match g {
                    [] => (Src::Imm(0), None),
                    [a] => (self.src(a, Ty::U32)?, None),
                    [a, b] => (self.src(a, Ty::U32)?, Some(self.src(b, Ty::U32)?)),
                    _ => return self.fail("bar takes a barrier and a thread count"),
                };
                Op::Bar {
                    id,
                    count,
                    wait: !has(mods, "arrive"),
                }
            }
            "membar" | "fence" | "prefetch" | "prefetchu" | "nanosleep" | "pmevent" => Op::Nop,
            "atom" | "red" => {
                let ty = self.ty(mods)?;
                let op = mods
                    .iter()
                    .find_map(|m| {
                        Some(match *m {
                            "add" => AtomOp::Add,
                            "min" => AtomOp::Min,
                            "max" => AtomOp::Max,
                            "inc" => AtomOp::Inc,
                            "dec" => AtomOp::Dec,
                            "and" => AtomOp::And,
                            "or" => AtomOp::Or,
                            "xor" => AtomOp::Xor,
                            "exch" => AtomOp::Exch,
                            "cas" => AtomOp::Cas,
                            _ => return None,
                        })
                    })
                    .ok_or((self.line, "atom without an operation".to_string()))?;
                let valid = match op {
                    AtomOp::Add => matches!(ty, Ty::U32 | Ty::S32 | Ty::U64 | Ty::F32 | Ty::F64),
                    AtomOp::Min | AtomOp::Max => {
                        matches!(ty, Ty::U32 | Ty::S32 | Ty::U64 | Ty::S64)
                    }
                    AtomOp::Inc | AtomOp::Dec => ty == Ty::U32,
                    AtomOp::And | AtomOp::Or | AtomOp::Xor | AtomOp::Exch | AtomOp::Cas => {
                        matches!(ty, Ty::B32 | Ty::B64)
                    }
                };
                if !valid {
                    return self.fail(format!(
                        "{base} of this operation on .{ty:?} is not supported"
                    ));
                }
                let space = space_of(mods);
                if matches!(space, Space::Const | Space::Param | Space::Local) {
                    return self.fail("atomics in this space do not exist");
                }
                let (d, rest) = if base == "atom" {
                    let Some((d, rest)) = g.split_first() else {
                        return self.fail("atom needs operands");
                    };
                    (self.dst(d)?, rest)
                } else {
                    (SINK, g)
                };
                let want = if op == AtomOp::Cas { 3 } else { 2 };
                if rest.len() != want {
                    return self.fail("wrong number of atomic operands");
                }
                Op::Atom {
                    space,
                    op,
                    ty,
                    d,
                    addr: self.addr(&rest[0])?,
                    b: self.src(&rest[1], ty)?,
                    c: if want == 3 {
                        self.src(&rest[2], ty)?
                    } else {
                        Src::Imm(0)
                    },
                }
            }
            "shfl" => {
                let mode = mods
                    .iter()
                    .find_map(|m| match *m {
                        "up" => Some(ShflMode::Up),
                        "down" => Some(ShflMode::Down),
                        "bfly" => Some(ShflMode::Bfly),
                        "idx" => Some(ShflMode::Idx),
                        _ => None,
                    })
                    .ok_or((self.line, "shfl without a mode".to_string()))?;
                let sync = has(mods, "sync");
                if g.len() != if sync { 5 } else { 4 } {
                    return self.fail("wrong number of shfl operands");
                }
                let (d, p) = match g[0].as_slice() {
                    [a, Tok::Punct('|'), b] => (
                        self.dst(std::slice::from_ref(a))?,
                        self.dst(std::slice::from_ref(b))?,
                    ),
                    d => (self.dst(d)?, SINK),
                };
                Op::Shfl {
                    mode,
                    d,
                    p,
                    a: self.src(&g[1], Ty::B32)?,
                    b: self.src(&g[2], Ty::U32)?,
                    c: self.src(&g[3], Ty::U32)?,
                    mask: if sync {
                        self.src(&g[4], Ty::U32)?
                    } else {
                        Src::Imm(0xffff_ffff)
                    },
                }
            }
            "vote" => {
                let mode = mods
                    .iter()
                    .find_map(|m| match *m {
                        "all" => Some(VoteMode::All),
                        "any" => Some(VoteMode::Any),
                        "uni" => Some(VoteMode::Uni),
                        "ballot" => Some(VoteMode::Ballot),
                        _ => None,
                    })
                    .ok_or((self.line, "vote without a mode".to_string()))?;
                let sync = has(mods, "sync");
                if g.len() != if sync { 3 } else { 2 } {
                    return self.fail("wrong number of vote operands");
                }
                let (negate, a) = match g[1].as_slice() {
                    [Tok::Punct('!'), rest @ ..] => (true, rest),
                    a => (false, a),
                };
                Op::Vote {
                    mode,
                    d: self.dst(&g[0])?,
                    a: self.src(a, Ty::Pred)?,
                    negate,
                    mask: if sync {
                        self.src(&g[2], Ty::U32)?
                    } else {
                        Src::Imm(0xffff_ffff)
                    },
                }
            }
            "match" => {
                let all = match (has(mods, "all"), has(mods, "any")) {
                    (true, false) => true,
                    (false, true) => false,
                    _ => return self.fail("match needs one of .any and .all"),
                };
                if !has(mods, "sync") {
                    return self.fail("match needs .sync");
                }
                let ty = self.ty(mods)?;
                let g = self.n_ops(g, 3)?;
                let (d, p) = match g[0].as_slice() {
                    [a, Tok::Punct('|'), b] if all => (
                        self.dst(std::slice::from_ref(a))?,
                        self.dst(std::slice::from_ref(b))?,
                    ),
                    d => (self.dst(d)?, SINK),
                };
                Op::Match {
                    all,
                    d,
                    p,
                    a: self.src(&g[1], ty)?,
                    mask: self.src(&g[2], Ty::U32)?,
                }
            }
            "activemask" => Op::Activemask {
                d: self.reg(&self.n_ops(g, 1)?[0])?,
            },
            "trap" | "brkpt" => Op::Trap,
            "tex" | "tld4" | "suld" | "sust" => self.texture(base, mods, g)?,
            "txq" | "suq" => self.query(base, mods, g)?,
            _ => return self.fail(format!("unsupported instruction {base}")),
        })
    }
}

impl Cx<'_> {
    /// `add.cc`, `addc{.cc}`, `sub.cc`, `subc{.cc}`, `mad{.lo,.hi}.cc`, `madc{.lo,.hi}{.cc}`
    /// on 32- and 64-bit integers.
    fn carry(&self, base: &str, mods: &[&str], g: &[Vec<Tok>]) -> PResult<Op> {
        let ty = self.ty(mods)?;
        if !matches!(ty, Ty::U32 | Ty::S32 | Ty::U64 | Ty::S64) {
            return self.fail(format!("{base} on .{ty:?} does not exist"));
        }
        let op = match base {
            "add" | "addc" => CarryOp::Add,
            "sub" | "subc" => CarryOp::Sub,
            _ => match (has(mods, "hi"), has(mods, "lo")) {
                (true, false) => CarryOp::Mad { hi: true },
                (false, true) => CarryOp::Mad { hi: false },
                _ => return self.fail(format!("{base} needs .lo or .hi")),
            },
        };
        let mad = matches!(op, CarryOp::Mad { .. });
        let g = self.n_ops(g, if mad { 4 } else { 3 })?;
        Ok(Op::Carry {
            op,
            carry_in: base.ends_with('c'),
            carry_out: has(mods, "cc"),
            ty,
            d: self.reg(&g[0])?,
            a: self.src(&g[1], ty)?,
            b: self.src(&g[2], ty)?,
            c: if mad {
                self.src(&g[3], ty)?
            } else {
                Src::Imm(0)
            },
        })
    }

    /// The lane-local bit instructions of [`BitOp`], their modes validated.
    fn bits(&self, base: &str, mods: &[&str], g: &[Vec<Tok>]) -> PResult<Op> {
        let one_of = |choices: [&str; 2]| -> PResult<bool> {
            match (has(mods, choices[0]), has(mods, choices[1])) {
                (true, false) => Ok(true),
                (false, true) => Ok(false),
                _ => self.fail(format!(
                    "{base} needs one of .{} and .{}",
                    choices[0], choices[1]
                )),
            }
        };
        let types: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
        let (op, ty, n) = match base {
            "lop3" => (BitOp::Lop3, Ty::B32, 5),
            "shf" => (
                BitOp::Shf {
                    left: one_of(["l", "r"])?,
                    clamp: one_of(["clamp", "wrap"])?,
                },
                Ty::B32,
                4,
            ),
            "bmsk" => (
                BitOp::Bmsk {
                    clamp: one_of(["clamp", "wrap"])?,
                },
                Ty::B32,
                3,
            ),
            "bfind" => (
                BitOp::Bfind {
                    shiftamt: has(mods, "shiftamt"),
                },
                self.ty(mods)?,
                2,
            ),
            "testp" => {
                let class = mods
                    .iter()
                    .find_map(|m| {
                        Some(match *m {
                            "finite" => FloatClass::Finite,
                            "infinite" => FloatClass::Infinite,
                            "number" => FloatClass::Number,
                            "notanumber" => FloatClass::NotANumber,
                            "normal" => FloatClass::Normal,
                            "subnormal" => FloatClass::Subnormal,
                            _ => return None,
                        })
                    })
                    .ok_or((self.line, "testp without a class".to_string()))?;
                (BitOp::Testp(class), self.ty(mods)?, 2)
            }
            "dp4a" | "dp2a" => {
                let [ta, tb] = types[..] else {
                    return self.fail(format!("{base} names two operand types"));
                };
                let (sa, sb) = (ta.signed(), tb.signed());
                let op = if base == "dp4a" {
                    if has(mods, "lo") || has(mods, "hi") {
                        return self.fail("dp4a takes no .lo or .hi");
                    }
                    BitOp::Dp4a { sa, sb }
                } else {
                    BitOp::Dp2a {
                        hi: one_of(["hi", "lo"])?,
                        sa,
                        sb,
                    }
                };
                (op, Ty::B32, 4)
            }
            _ => {
                let mode = mods
                    .iter()
                    .find_map(|m| {
                        Some(match *m {
                            "f4e" => PrmtMode::F4e,
                            "b4e" => PrmtMode::B4e,
                            "rc8" => PrmtMode::Rc8,
                            "ecl" => PrmtMode::Ecl,
                            "ecr" => PrmtMode::Ecr,
                            "rc16" => PrmtMode::Rc16,
                            _ => return None,
                        })
                    })
                    .ok_or((self.line, "prmt with two modes".to_string()))?;
                (BitOp::Prmt(mode), Ty::B32, 4)
            }
        };
        if base != "dp4a" && base != "dp2a" && types.len() != 1 {
            return self.fail(format!("{base} names one type"));
        }
        let g = self.n_ops(g, n)?;
        let mut srcs = [Src::Imm(0); 4];
        for (s, o) in srcs.iter_mut().zip(&g[1..]) {
            *s = self.src(o, ty)?;
        }
        Ok(Op::Bits {
            op,
            ty,
            d: self.dst(&g[0])?,
            srcs,
        })
    }

    /// `txq.q.b32 d, [handle]` and `suq.q.b32 d, [handle]`.
    fn query(&self, base: &str, mods: &[&str], g: &[Vec<Tok>]) -> PResult<Op> {
        let surface = base == "suq";
        let q = match mods {
            [q, "b32"] => super::texture::Query::parse(q)
                .filter(|q| !surface || q.of_surfaces())
                .ok_or((self.line, format!("{base}.{q} is not supported")))?,
            _ => return self.fail(format!("{base} takes .query.b32")),
        };
        let g = self.n_ops(g, 2)?;
        let [Tok::Punct('['), inner @ .., Tok::Punct(']')] = g[1].as_slice() else {
            return self.fail(format!("{base} takes [handle]"));
        };
        Ok(Op::Query(ObjectQuery {
            surface,
            q,
            d: self.dst(&g[0])?,
            handle: self.src(inner, Ty::U64)?,
        }))
    }

    /// `tex`, `tld4`, `suld.b` and `sust.b` in unified mode (the object's handle in a
    /// register or parameter): see `texture`.
    fn texture(&self, base: &str, mods: &[&str], g: &[Vec<Tok>]) -> PResult<Op> {
        use super::texture::{Geom, Oob};
        let level = base == "tex" && has(mods, "level");
        let grad = base == "tex" && has(mods, "grad");
        for m in ["base", "p"] {
            if has(mods, m) {
                return self.fail(format!("{base}.{m} is not supported"));
            }
        }
        let geom = mods
            .iter()
            .find_map(|m| Geom::parse(m))
            .ok_or((self.line, format!("{base} without a geometry")))?;
        let g = self.n_ops(g, 2 + usize::from(level) + 2 * usize::from(grad))?;
        let lod = if level {
            Lod::Level(self.src(&g[2], Ty::F32)?)
        } else if grad {
            if matches!(geom, Geom::Cube | Geom::ACube) {
                return self.fail("tex.grad of a cubemap is not supported");
            }
            // `{dx...}, {dy...}`: as many as the coordinates (a padded 4 for 3D).
            let n = match geom {
                Geom::D1 | Geom::A1 => 1,
                Geom::D2 | Geom::A2 => 2,
                _ => 4,
            };
            let mut v = [[Src::Imm(0); 3]; 2];
            for (dv, gv) in v.iter_mut().zip(&g[2..4]) {
                let parts = self.vector(gv)?;
                if parts.len() != n {
                    return self.fail("tex.grad: gradient width and geometry differ");
                }
                for (d, p) in dv.iter_mut().zip(&parts) {
                    *d = self.src(p, Ty::F32)?;
                }
            }
            Lod::Grad(v[0], v[1])
        } else {
            Lod::Implicit
        };
        let (obj, val) = if base == "sust" {
            (&g[0], &g[1])
        } else {
            (&g[1], &g[0])
        };
        // `[handle, {c0, ...}]`
        let [Tok::Punct('['), inner @ .., Tok::Punct(']')] = obj.as_slice() else {
            return self.fail(format!("{base} takes [handle, {{coordinates}}]"));
        };
        let Some(comma) = inner.iter().position(|t| *t == Tok::Punct(',')) else {
            return self.fail(format!("{base} takes [handle, {{coordinates}}]"));
        };
        let handle = self.src(&inner[..comma], Ty::U64)?;
        let cs = self.vector(&inner[comma + 1..])?;
        if cs.len() != geom.operands() {
            return self.fail(format!("{base}: {} coordinates for {geom:?}", cs.len()));
        }
        let types: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
        let fetch = base == "tex" || base == "tld4";
        let float = fetch && types.last() == Some(&Ty::F32);
        if (level || grad) && !float {
            return self.fail("tex.level and tex.grad with integer coordinates");
        }
        let layered = matches!(geom, Geom::A1 | Geom::A2 | Geom::ACube);
        let mut coords = [Src::Imm(0); 4];
        for (i, (c, t)) in coords.iter_mut().zip(&cs).enumerate() {
            let ty = if float && !(layered && i == 0) {
                Ty::F32
            } else {
                Ty::S32
            };
            *c = self.src(t, ty)?;
        }
        let n: u8 = if has(mods, "v4") {
            4
        } else if has(mods, "v2") {
            2
        } else {
            1
        };
        let list = |n: usize| -> PResult<Vec<&[Tok]>> {
            // A single value may be braced too (`sust.b.2d.b32 [...], {%r1}`).
            let v = if Self::is_vector(val) {
                self.vector(val)?
            } else {
                vec![val.as_slice()]
            };
            if v.len() != n {
                return self.fail("vector width and operand count differ");
            }
            Ok(v)
        };
        if fetch {
            if n != 4 || !matches!(types.first(), Some(Ty::F32 | Ty::S32 | Ty::U32)) {
                return self.fail(format!("{base} returns .v4.f32, .v4.s32 or .v4.u32"));
            }
            let gather = match base {
                "tld4" if geom != Geom::D2 || !float => {
                    return self.fail("tld4 of other than .2d with .f32 coordinates");
                }
                "tld4" => Some(
                    ["r", "g", "b", "a"]
                        .iter()
                        .position(|c| has(mods, c))
                        .ok_or((self.line, "tld4 without a channel".to_string()))?
                        as u8,
                ),
                _ => None,
            };
            let mut ds = [SINK; 4];
            for (d, v) in ds.iter_mut().zip(list(4)?) {
                *d = self.dst(v)?;
            }
            return Ok(Op::Tex {
                geom,
                int: !float,
                gather,
                lod,
                ds,
                handle,
                coords,
            });
        }
        if !has(mods, "b") || matches!(geom, Geom::Cube | Geom::ACube) {
            return self.fail(format!("{base} of other than .b 1d/2d/3d/a1d/a2d"));
        }
        let ty = self.ty(mods)?;
        if !matches!(ty, Ty::B8 | Ty::B16 | Ty::B32 | Ty::B64) || (ty == Ty::B64 && n == 4) {
            return self.fail(format!("{base} of .{ty:?} x {n}"));
        }
        let oob = if has(mods, "clamp") {
            Oob::Clamp
        } else if has(mods, "zero") {
            Oob::Zero
        } else {
            Oob::Trap
        };
        let mut vals = [Src::Imm(0); 4];
        for (s, v) in vals.iter_mut().zip(list(usize::from(n))?) {
            *s = if base == "sust" {
                self.src(v, ty)?
            } else {
                Src::Reg(self.dst(v)?)
            };
        }
        Ok(Op::Surf {
            store: base == "sust",
            geom,
            ty,
            n,
            oob,
            vals,
            handle,
            coords,
        })
    }
}

/// The 64-bit counterpart of a 32-bit (or 16-bit) integer type for `.wide` results.
pub(crate) fn wide(ty: Ty) -> Ty {
    match ty {
        Ty::S16 => Ty::S32,
        Ty::U16 => Ty::U32,
        Ty::S32 => Ty::S64,
        _ => Ty::U64,
    }
}

fn cmp_of(m: &str) -> Option<Cmp> {
    Some(match m {
        "eq" => Cmp::Eq,
        "ne" => Cmp::Ne,
        "lt" => Cmp::Lt,
        "le" => Cmp::Le,
        "gt" => Cmp::Gt,
        "ge" => Cmp::Ge,
        "lo" => Cmp::Lo,
        "ls" => Cmp::Ls,
        "hi" => Cmp::Hi,
        "hs" => Cmp::Hs,
        "equ" => Cmp::Equ,
        "neu" => Cmp::Neu,
        "ltu" => Cmp::Ltu,
        "leu" => Cmp::Leu,
        "gtu" => Cmp::Gtu,
        "geu" => Cmp::Geu,
        "num" => Cmp::Num,
        "nan" => Cmp::Nan,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, mpsc};
    use std::time::{Duration, Instant};

    use super::super::Module;
    use super::*;
    use crate::budget::MemoryBudget;
    use crate::compute::{ComputeBackend, CpuBackend, CpuConfig};

    const HEAD: &str = ".version 8.5\n.target sm_75\n.address_size 64\n";

    /// A kernel `depth` scopes deep with `insts` instructions at the innermost that name
    /// registers of the outermost.
    fn deep(depth: usize, insts: usize) -> String {
        let mut t = format!("{HEAD}.visible .entry k()\n{{\n.reg .b32 %r<3>;\n");
        t.push_str(&"{\n".repeat(depth));
        t.push_str(&"add.s32 %r2, %r1, %r0;\n".repeat(insts));
        t.push_str(&"}\n".repeat(depth));
        t.push_str("ret;\n}\n");
        t
    }

    /// A kernel of `insts` instructions.
    fn long(insts: usize) -> String {
        deep(0, insts)
    }

    #[test]
    fn inner_scopes_hide_outer_names_until_they_close() {
        let text = format!(
            "{HEAD}.visible .entry k(.param .u64 p)\n{{\n.reg .b32 %r<2>;\n.reg .b64 %rd<2>;\n\
             ld.param.u64 %rd1, [p];\nmov.u32 %r1, 1;\n\
             {{\n.reg .b32 %r1;\nmov.u32 %r1, 2;\n{{\nmov.u32 %r1, 3;\n}}\n}}\n\
             st.global.u32 [%rd1], %r1;\nret;\n}}\n"
        );
        let (budget, never) = (MemoryBudget::new(u64::MAX), AtomicBool::new(false));
        let (parsed, _) = parse(&[&text], Meter::new(&budget, &never)).unwrap();
        let movs: Vec<u32> = parsed
            .code
            .iter()
            .filter_map(|i| match i.op {
                Op::Mov { d, .. } => Some(d),
                _ => None,
            })
            .collect();
        let [outer, inner, innermost] = movs[..] else {
            panic!("{movs:?}");
        };
        assert_ne!(outer, inner);
        assert_eq!(inner, innermost, "a nested scope sees its parent's names");
        let stored = parsed.code.iter().find_map(|i| match i.op {
            Op::St { srcs, .. } => Some(srcs[0]),
            _ => None,
        });
        assert_eq!(stored, Some(Src::Reg(outer)), "the outer %r1 is back");
    }

    #[test]
    fn names_cost_one_lookup_whatever_the_nesting() {
        // 200k scopes x 20k instructions: each name looked up through every scope took 16.8
        // CPU-s in a release build. A watchdog cancels the parse after a minute, far more
        // than a parse linear in its 1.3 MB needs even in a debug build.
        let text = deep(200_000, 20_000);
        let cancel = Arc::new(AtomicBool::new(false));
        let (done, wait) = mpsc::channel::<()>();
        let watchdog = {
            let cancel = Arc::clone(&cancel);
            std::thread::spawn(move || {
                if wait.recv_timeout(Duration::from_secs(60)).is_err() {
                    cancel.store(true, Ordering::Relaxed);
                }
            })
        };
        let budget = MemoryBudget::new(u64::MAX);
        let loaded = Module::load(&[&text], &budget, &cancel);
        drop(done);
        watchdog.join().unwrap();
        let (module, charge) = loaded.expect("parsed before the watchdog");
        assert_eq!(
            module.parsed.code.len(),
            20_002,
            "the adds, ret and the implicit exit"
        );
        assert_eq!(budget.used(), charge.bytes());
    }

    #[test]
    fn a_parse_is_charged_while_it_runs_and_past_its_budget_is_out_of_memory() {
        let text = long(10_000);
        let never = AtomicBool::new(false);
        let budget = MemoryBudget::new(u64::MAX);
        let (module, charge) = Module::load(&[&text], &budget, &never).unwrap();
        let code = (module.parsed.code.len() * size_of::<Inst>()) as u64;
        assert!(charge.bytes() >= code, "{} < {code}", charge.bytes());
        assert!(charge.bytes() < 2 * code + METER_STEP, "{}", charge.bytes());
        assert_eq!(budget.used(), charge.bytes());
        drop((module, charge));
        assert_eq!(budget.used(), 0);

        let small = MemoryBudget::new(256 << 10);
        let e = Module::load(&[&text], &small, &never).unwrap_err();
        assert_eq!(e.cuda_status(), 2, "{e}");
        assert_eq!(small.used(), 0, "everything given back");
        // Zero-filled variables are charged too: 64 of 256 MiB each would be 16 GiB.
        let vars: String = (0..64)
            .map(|i| format!(".global .align 4 .b8 v{i}[268435456];\n"))
            .collect();
        let e = Module::load(&[&format!("{HEAD}{vars}")], &small, &never).unwrap_err();
        assert_eq!(e.cuda_status(), 2, "{e}");
        assert_eq!(small.used(), 0);
    }

    #[test]
    fn a_module_load_past_the_vms_budget_is_out_of_memory_and_gives_it_back() {
        // What a context holds of the budget before any module.
        let probe = MemoryBudget::new(u64::MAX);
        let mut be = CpuBackend::new(CpuConfig {
            budget: Arc::clone(&probe),
            ..CpuConfig::default()
        });
        be.context_create().unwrap();
        let budget = MemoryBudget::new(probe.used() + (256 << 10));
        let mut be = CpuBackend::new(CpuConfig {
            budget: Arc::clone(&budget),
            ..CpuConfig::default()
        });
        let ctx = be.context_create().unwrap();
        let before = budget.used();
        let e = be.module_load(ctx, long(10_000).as_bytes()).unwrap_err();
        assert_eq!(e.cuda_status(), 2, "{e}");
        assert_eq!(budget.used(), before);
        // A small module fits, is charged while loaded and given back at unload.
        let m = be.module_load(ctx, long(10).as_bytes()).unwrap();
        assert!(budget.used() > before);
        be.module_unload(ctx, m).unwrap();
        assert_eq!(budget.used(), before);
        let m = be.module_load(ctx, long(10).as_bytes()).unwrap();
        be.function(ctx, m, "k").unwrap();
        be.context_destroy(ctx).unwrap();
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_cancelled_parse_stops_and_gives_everything_back() {
        let text = long(1_000_000);
        let budget = MemoryBudget::new(u64::MAX);
        let cancel = Arc::new(AtomicBool::new(false));
        let (b, c) = (Arc::clone(&budget), Arc::clone(&cancel));
        // The thread keeps what it loaded until joined, so the budget cannot fall back
        // before it is seen: a parse that outran the flag fails the test, never hangs it.
        let parser = std::thread::spawn(move || {
            let r = Module::load(&[&text], &b, &c);
            (r, Instant::now())
        });
        // Once the parse holds a megabyte it is under way: cancel it.
        while budget.used() < 1 << 20 {
            std::thread::yield_now();
        }
        let at = Instant::now();
        cancel.store(true, Ordering::Relaxed);
        let (r, returned) = parser.join().unwrap();
        eprintln!("the parse returned {:?} after the flag", returned - at);
        assert_eq!(r.map(drop).unwrap_err(), Stop::Cancelled.error());
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn the_lexer_stops_when_cancelled_and_takes_any_white_space() {
        let budget = MemoryBudget::new(u64::MAX);
        let cancelled = AtomicBool::new(true);
        let meter = Meter::new(&budget, &cancelled);
        let text = long(10);
        assert_eq!(Lexer::new(&text).next(&meter), Err(Stop::Cancelled));
        let never = AtomicBool::new(false);
        let e = Module::load(&[&text], &budget, &cancelled).unwrap_err();
        assert_eq!(e, Stop::Cancelled.error());
        assert_eq!(budget.used(), 0);
        let spaced = format!("{HEAD}\u{a0}.visible .entry k() {{ ret; }}\n");
        assert!(
            Module::load(&[&spaced], &budget, &never).is_ok(),
            "U+00A0 is white space"
        );
    }

    #[test]
    fn an_error_quotes_at_most_a_little_of_a_name() {
        let name = "a".repeat(1 << 20);
        let e = Module::parse(&format!("{HEAD}{name}")).unwrap_err();
        assert!(e.to_string().len() < 2 * MAX_MESSAGE_BYTES, "{e}");
        let e = Module::parse(&format!("{HEAD}.visible .entry k() {{ bra {name}; }}")).unwrap_err();
        assert!(e.to_string().len() < 2 * MAX_MESSAGE_BYTES, "{e}");
    }
}
