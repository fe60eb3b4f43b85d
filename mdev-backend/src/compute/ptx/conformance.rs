//! Conformance of the executor's instructions, generated per instruction, type and modifier:
//! each case is one PTX kernel applying the instruction to every lane's operands (edge values
//! and seeded random ones), and every lane's result is compared bit for bit with a host
//! reference written from the PTX ISA's definitions. Directed rounding is checked against an
//! exact computation: the reference takes the host's correctly rounded nearest result and asks
//! an exact big-integer sum on which side of it the true result lies.
//!
//! NaN results of arithmetic are compared as NaNs only (the ISA does not define their
//! payload); `min`/`max`, whose NaN results the ISA defines, are compared bit for bit.

use super::*;
use std::cmp::Ordering;

/// Operand values one lane reads and the reference that gives its result.
type Reference = Box<dyn Fn(&[u64]) -> u64>;

/// One generated case.
struct Case {
    /// The instruction as PTX writes it, without operands (`add.rz.f32`).
    inst: String,
    /// The destination's register type.
    dst: &'static str,
    /// The operands' register types.
    srcs: Vec<&'static str>,
    reference: Reference,
    /// Whether a NaN result matches any NaN (arithmetic) or only its own bits.
    nan_any: bool,
    /// Immediate operands written after the loaded ones (`lop3`'s table).
    imm: String,
    /// Instructions that replace `inst %d, operands;` (a carry chain's several).
    body: Option<String>,
}

/// A fixed-seed generator (xorshift64*), so a failure reproduces.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn f32_edges() -> Vec<u64> {
    let v: [f32; 14] = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        3.0,
        0.1,
        1.0 + f32::EPSILON,
        -(1.0 + 2.0 * f32::EPSILON),
        f32::MIN_POSITIVE,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        16_777_217.0,
    ];
    let mut out: Vec<u64> = v.iter().map(|x| u64::from(x.to_bits())).collect();
    // Subnormals, NaNs with payloads (quiet and signalling), values around ties.
    out.extend([
        0x0000_0001,
        0x807f_ffff,
        0x7fc0_0001,
        0xffc1_2345,
        0x7f80_0001,
    ]);
    out.extend([0x4b00_0001, 0x3f80_0001, 0x3eaa_aaab]);
    out
}

fn f64_edges() -> Vec<u64> {
    let v: [f64; 13] = [
        0.0,
        -0.0,
        1.0,
        -1.0,
        3.0,
        0.1,
        1.0 + f64::EPSILON,
        f64::MIN_POSITIVE,
        f64::MAX,
        f64::MIN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        9_007_199_254_740_993.0,
    ];
    let mut out: Vec<u64> = v.iter().map(|x| x.to_bits()).collect();
    out.extend([
        0x0000_0000_0000_0001,
        0x800f_ffff_ffff_ffff,
        0x7ff8_0000_0000_0001,
        0xfff1_2345_6789_abcd,
        0x3ff0_0000_0000_0001,
        0x3fd5_5555_5555_5555,
    ]);
    out
}

fn int_edges(bits: u32) -> Vec<u64> {
    let mask = if bits == 64 {
        u64::MAX
    } else {
        (1 << bits) - 1
    };
    let min = 1u64 << (bits - 1);
    [
        0,
        1,
        2,
        3,
        7,
        31,
        32,
        33,
        63,
        64,
        mask,
        min,
        min - 1,
        min + 1,
        0x5a5a_5a5a_5a5a_5a5a,
    ]
    .iter()
    .map(|v| v & mask)
    .collect()
}

/// Values of a register type: edges first, then random ones.
fn values(ty: &str, rng: &mut Rng, n: usize) -> Vec<u64> {
    let (edges, mask, float32) = match ty {
        "f16" => (f16_edges(), 0xffff, false),
        "f16x2" => {
            let e = f16_edges();
            let pairs = e.iter().zip(e.iter().rev()).map(|(a, b)| a | b << 16);
            (pairs.collect(), 0xffff_ffff, false)
        }
        "f32" => (f32_edges(), 0xffff_ffff, true),
        "f64" => (f64_edges(), u64::MAX, false),
        t => {
            let bits: u32 = t[1..].parse().unwrap();
            let m = if bits == 64 {
                u64::MAX
            } else {
                (1 << bits) - 1
            };
            (int_edges(bits), m, false)
        }
    };
    let mut v = edges;
    while v.len() < n {
        let r = rng.next();
        // Random floats of moderate exponents, so sums and products round.
        let r = if float32 {
            u64::from(((r as u32) & 0x807f_ffff) | ((0x70 + (r >> 40) % 32) as u32) << 23)
        } else if ty == "f64" {
            (r & 0x800f_ffff_ffff_ffff) | ((0x3e0 + (r >> 52) % 64) << 52)
        } else if ty.starts_with("f16") {
            // Exponents around 1 so sums round, and some past the subnormal boundary.
            let half = |x: u64| (x & 0x83ff) | ((6 + (x >> 11) % 20) << 10);
            half(r) | half(r >> 20) << 16
        } else {
            r
        };
        v.push(r & mask);
    }
    v
}

/// The lanes' operands: every pair (or triple, cycling) of edge values and random ones.
fn operands(c: &Case, rng: &mut Rng) -> Vec<Vec<u64>> {
    let pools: Vec<Vec<u64>> = c.srcs.iter().map(|t| values(t, rng, 32)).collect();
    let mut lanes = Vec::new();
    match pools.len() {
        1 => lanes.extend(pools[0].iter().map(|&a| vec![a])),
        2 => {
            for &a in &pools[0] {
                for &b in &pools[1] {
                    lanes.push(vec![a, b]);
                }
            }
        }
        _ => {
            for (i, &a) in pools[0].iter().enumerate() {
                for (j, &b) in pools[1].iter().enumerate() {
                    lanes.push(vec![a, b, pools[2][(i * 7 + j) % pools[2].len()]]);
                }
            }
        }
    }
    lanes
}

/// Runs `c` on the executor: one thread per lane of operands; each lane's result.
fn execute(c: &Case, lanes: &[Vec<u64>]) -> Vec<u64> {
    let n = c.srcs.len();
    let names = ["%a", "%b", "%c"];
    let mut decl = String::new();
    let mut loads = String::new();
    for (i, t) in c.srcs.iter().enumerate() {
        decl += &format!(".reg .{t} {};\n", names[i]);
        loads += &format!("ld.global.{} {}, [%rd3+{}];\n", bits_of(t), names[i], i * 8);
    }
    let ops = names[..n].join(", ") + &c.imm;
    let body = c
        .body
        .clone()
        .unwrap_or_else(|| format!("{} %d, {ops};", c.inst));
    // A predicate result is stored as 0 or 1.
    let (dreg, store, result, out) = if c.dst == "pred" {
        ("pred", "u32", "selp.u32 %r2, 1, 0, %d;\n", "%r2")
    } else {
        (c.dst, bits_of(c.dst), "", "%d")
    };
    let ptx = format!(
        ".visible .entry k(.param .u64 in, .param .u64 out, .param .u32 n)\n{{\n\
         .reg .b64 %rd<6>;\n.reg .b32 %r<4>;\n.reg .pred %p;\n{decl}.reg .{dreg} %d;\n\
         ld.param.u64 %rd1, [in];\nld.param.u64 %rd2, [out];\nld.param.u32 %r3, [n];\n\
         mov.u32 %r1, %ctaid.x;\nmov.u32 %r2, %ntid.x;\nmov.u32 %r0, %tid.x;\n\
         mad.lo.s32 %r1, %r1, %r2, %r0;\nsetp.ge.u32 %p, %r1, %r3;\n@%p bra $L_end;\n\
         mul.wide.u32 %rd3, %r1, {stride};\nadd.s64 %rd3, %rd1, %rd3;\n{loads}\
         {body}\n{result}mul.wide.u32 %rd4, %r1, 8;\nadd.s64 %rd4, %rd2, %rd4;\n\
         st.global.{store} [%rd4], {out};\n$L_end:\nret;\n}}\n",
        stride = n * 8,
    );
    let m = module(&ptx);
    let mut r = Run::new(&m);
    let input: Vec<u8> = lanes
        .iter()
        .flat_map(|l| l.iter().flat_map(|v| v.to_le_bytes()))
        .collect();
    let input = r.buffer(&input);
    let out = r.buffer(&vec![0; lanes.len() * 8]);
    let params = pack(&m, "k", &[input, out, lanes.len() as u64]);
    let block = 256u32;
    let grid = (lanes.len() as u32).div_ceil(block);
    r.launch("k", [grid, 1, 1], [block, 1, 1], &params, 1)
        .unwrap_or_else(|e| panic!("{}: {e}", c.inst));
    r.read(out, lanes.len() * 8)
        .chunks(8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// The type a register of `ty` is loaded and stored as (half precision has no loads).
fn bits_of(ty: &'static str) -> &'static str {
    match ty {
        "f16" => "b16",
        "f16x2" => "b32",
        t => t,
    }
}

fn is_nan(ty: &str, v: u64) -> bool {
    match ty {
        "f16" => v & 0x7fff > 0x7c00,
        "f32" => f32::from_bits(v as u32).is_nan(),
        "f64" => f64::from_bits(v).is_nan(),
        _ => false,
    }
}

fn width_mask(ty: &str) -> u64 {
    if ty == "pred" {
        return 1;
    }
    match ty[1..].trim_end_matches("x2").parse::<u32>().unwrap()
        * if ty.ends_with("x2") { 2 } else { 1 }
    {
        64 => u64::MAX,
        b => (1 << b) - 1,
    }
}

/// Runs every case and reports each lane that differs from its reference.
fn check(cases: Vec<Case>) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut failures = Vec::new();
    for c in &cases {
        let lanes = operands(c, &mut rng);
        let got = execute(c, &lanes);
        let mask = width_mask(c.dst);
        for (ops, &g) in lanes.iter().zip(&got) {
            let want = (c.reference)(ops) & mask;
            let g = g & mask;
            let same = g == want || c.nan_any && is_nan(c.dst, g) && is_nan(c.dst, want);
            if !same && failures.len() < 20 {
                failures.push(format!("{} {ops:x?}: got {g:#x}, want {want:#x}", c.inst));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---- exact references ----

/// A finite float as (negative, mantissa, exponent): (-1)^neg * m * 2^e.
fn parts(v: f64) -> (bool, u128, i32) {
    let b = v.to_bits();
    let exp = ((b >> 52) & 0x7ff) as i32;
    let frac = b & ((1 << 52) - 1);
    let (m, e) = if exp == 0 {
        (frac, -1074)
    } else {
        (frac | 1 << 52, exp - 1075)
    };
    (v.is_sign_negative(), u128::from(m), e)
}

/// A term of an exact sum: ±m·2^e.
type Term = (bool, u128, i32);

fn product(a: f64, b: f64, negate: bool) -> Term {
    let (sa, ma, ea) = parts(a);
    let (sb, mb, eb) = parts(b);
    (sa ^ sb ^ negate, ma * mb, ea + eb)
}

fn term(a: f64, negate: bool) -> Term {
    let (s, m, e) = parts(a);
    (s ^ negate, m, e)
}

/// Adds `m << shift` into the little-endian words of `acc`.
fn add_shifted(acc: &mut [u64], m: u128, shift: usize) {
    let (word, bit) = (shift / 64, shift % 64);
    let pieces = [
        (m << bit) as u64,
        ((m << bit) >> 64) as u64,
        if bit == 0 {
            0
        } else {
            (m >> (128 - bit)) as u64
        },
    ];
    let mut carry = 0u128;
    for (i, slot) in acc.iter_mut().enumerate().skip(word) {
        let add = pieces.get(i - word).copied().unwrap_or(0);
        let s = u128::from(*slot) + u128::from(add) + carry;
        *slot = s as u64;
        carry = s >> 64;
        if carry == 0 && i >= word + 2 {
            break;
        }
    }
}

/// The sign of an exact sum of terms, from big integers.
fn exact_sign(terms: &[Term]) -> Ordering {
    let Some(emin) = terms.iter().filter(|t| t.1 != 0).map(|t| t.2).min() else {
        return Ordering::Equal;
    };
    let span = terms
        .iter()
        .filter(|t| t.1 != 0)
        .map(|t| (t.2 - emin) as usize)
        .max()
        .unwrap_or(0);
    let words = span / 64 + 4;
    let (mut pos, mut neg) = (vec![0u64; words], vec![0u64; words]);
    for &(s, m, e) in terms.iter().filter(|t| t.1 != 0) {
        add_shifted(if s { &mut neg } else { &mut pos }, m, (e - emin) as usize);
    }
    pos.iter().rev().cmp(neg.iter().rev())
}

#[derive(Clone, Copy)]
enum Mode {
    Rn,
    Rz,
    Rm,
    Rp,
}

const MODES: [(Mode, &str); 4] = [
    (Mode::Rn, "rn"),
    (Mode::Rz, "rz"),
    (Mode::Rm, "rm"),
    (Mode::Rp, "rp"),
];

/// Steps the nearest result `n` to the directed one, knowing where the exact value lies.
/// `finite`: the exact value is finite (an infinite `n` is then an overflow).
macro_rules! directed_ref {
    ($name:ident, $t:ty) => {
        fn $name(n: $t, terms: &[Term], finite: bool, mode: Mode) -> $t {
            if n.is_nan() || !finite {
                return n;
            }
            let ord = if n.is_infinite() {
                if n > 0.0 {
                    Ordering::Less
                } else {
                    Ordering::Greater
                }
            } else {
                let mut all = terms.to_vec();
                all.push(term(n.into(), true));
                exact_sign(&all)
            };
            match (mode, ord) {
                (Mode::Rm, Ordering::Less) => n.next_down(),
                (Mode::Rp, Ordering::Greater) => n.next_up(),
                (Mode::Rz, Ordering::Less) if n > 0.0 => n.next_down(),
                (Mode::Rz, Ordering::Greater) if n < 0.0 => n.next_up(),
                _ => n,
            }
        }
    };
}
directed_ref!(round32, f32);
directed_ref!(round64, f64);

fn f32v(v: u64) -> f32 {
    f32::from_bits(v as u32)
}

fn bits32(v: f32) -> u64 {
    u64::from(v.to_bits())
}

/// Float operations in every rounding mode, f32 and f64.
fn float_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (mode, m) in MODES {
        for (op, neg) in [("add", false), ("sub", true), ("mul", false)] {
            let f32ref = move |o: &[u64]| {
                let (a, b) = (f32v(o[0]), f32v(o[1]));
                let (n, terms) = match op {
                    "mul" => (a * b, vec![product(a.into(), b.into(), false)]),
                    _ => {
                        let b = if neg { -b } else { b };
                        (a + b, vec![term(a.into(), false), term(b.into(), false)])
                    }
                };
                bits32(round32(n, &terms, a.is_finite() && b.is_finite(), mode))
            };
            let f64ref = move |o: &[u64]| {
                let (a, b) = (f64::from_bits(o[0]), f64::from_bits(o[1]));
                let (n, terms) = match op {
                    "mul" => (a * b, vec![product(a, b, false)]),
                    _ => {
                        let b = if neg { -b } else { b };
                        (a + b, vec![term(a, false), term(b, false)])
                    }
                };
                round64(n, &terms, a.is_finite() && b.is_finite(), mode).to_bits()
            };
            cases.push(float_case(
                format!("{op}.{m}.f32"),
                "f32",
                2,
                Box::new(f32ref),
            ));
            cases.push(float_case(
                format!("{op}.{m}.f64"),
                "f64",
                2,
                Box::new(f64ref),
            ));
        }
        cases.push(float_case(
            format!("fma.{m}.f32"),
            "f32",
            3,
            Box::new(move |o| {
                let (a, b, c) = (f32v(o[0]), f32v(o[1]), f32v(o[2]));
                let terms = [product(a.into(), b.into(), false), term(c.into(), false)];
                let finite = a.is_finite() && b.is_finite() && c.is_finite();
                bits32(round32(a.mul_add(b, c), &terms, finite, mode))
            }),
        ));
        cases.push(float_case(
            format!("div.{m}.f32"),
            "f32",
            2,
            Box::new(move |o| {
                let (a, b) = (f32v(o[0]), f32v(o[1]));
                let n = a / b;
                // a/b against n: the sign of a - n*b, turned by the sign of b.
                let ord_terms = [
                    term(a.into(), b < 0.0),
                    product(n.into(), b.into(), b >= 0.0),
                ];
                let finite = a.is_finite() && b.is_finite() && b != 0.0;
                bits32(round32_via(n, &ord_terms, finite, mode))
            }),
        ));
        cases.push(float_case(
            format!("sqrt.{m}.f32"),
            "f32",
            1,
            Box::new(move |o| {
                let a = f32v(o[0]);
                let n = a.sqrt();
                let ord_terms = [term(a.into(), false), product(n.into(), n.into(), true)];
                bits32(round32_via(n, &ord_terms, a.is_finite() && a >= 0.0, mode))
            }),
        ));
        cases.push(float_case(
            format!("rcp.{m}.f32"),
            "f32",
            1,
            Box::new(move |o| {
                let a = f32v(o[0]);
                let n = 1.0 / a;
                let ord_terms = [term(1.0, a < 0.0), product(n.into(), a.into(), a >= 0.0)];
                bits32(round32_via(n, &ord_terms, a.is_finite() && a != 0.0, mode))
            }),
        ));
    }
    for (mode, m) in MODES {
        cases.push(float_case(
            format!("div.{m}.f64"),
            "f64",
            2,
            Box::new(move |o| {
                let (a, b) = (f64::from_bits(o[0]), f64::from_bits(o[1]));
                let n = a / b;
                let ord_terms = [term(a, b < 0.0), product(n, b, b >= 0.0)];
                let finite = a.is_finite() && b.is_finite() && b != 0.0;
                round64_via(n, &ord_terms, finite, mode).to_bits()
            }),
        ));
        cases.push(float_case(
            format!("sqrt.{m}.f64"),
            "f64",
            1,
            Box::new(move |o| {
                let a = f64::from_bits(o[0]);
                let n = a.sqrt();
                let ord_terms = [term(a, false), product(n, n, true)];
                round64_via(n, &ord_terms, a.is_finite() && a >= 0.0, mode).to_bits()
            }),
        ));
        cases.push(float_case(
            format!("rcp.{m}.f64"),
            "f64",
            1,
            Box::new(move |o| {
                let a = f64::from_bits(o[0]);
                let n = 1.0 / a;
                let ord_terms = [term(1.0, a < 0.0), product(n, a, a >= 0.0)];
                round64_via(n, &ord_terms, a.is_finite() && a != 0.0, mode).to_bits()
            }),
        ));
    }
    cases.push(float_case(
        "fma.rn.f64".into(),
        "f64",
        3,
        Box::new(|o| {
            let [a, b, c] = [0, 1, 2].map(|i| f64::from_bits(o[i]));
            a.mul_add(b, c).to_bits()
        }),
    ));
    cases
}

/// [`round32`] where the exact comparison is given directly as terms whose sum has the
/// sign of `exact - n` (division, square root, reciprocal).
fn round32_via(n: f32, ord_terms: &[Term], finite: bool, mode: Mode) -> f32 {
    // Adding n back makes the terms' sum "exact" for round32, which subtracts it again.
    let mut terms = ord_terms.to_vec();
    if !n.is_nan() && n.is_finite() {
        terms.push(term(n.into(), false));
    }
    round32(n, &terms, finite, mode)
}

/// [`round32_via`] for f64.
fn round64_via(n: f64, ord_terms: &[Term], finite: bool, mode: Mode) -> f64 {
    let mut terms = ord_terms.to_vec();
    if n.is_finite() {
        terms.push(term(n, false));
    }
    round64(n, &terms, finite, mode)
}

fn float_case(inst: String, ty: &'static str, n: usize, reference: Reference) -> Case {
    Case {
        inst,
        dst: ty,
        srcs: vec![ty; n],
        reference,
        nan_any: true,
        imm: String::new(),
        body: None,
    }
}

/// `min`/`max` (the ISA's NaN and signed-zero rules), `.ftz` forms and sign operations.
fn float_misc_cases() -> Vec<Case> {
    fn pick(a: f64, b: f64, xa: u64, xb: u64, min: bool, canonical: u64) -> u64 {
        match (a.is_nan(), b.is_nan()) {
            (true, true) => canonical,
            (true, false) => xb,
            (false, true) => xa,
            _ if a == b => {
                if a.is_sign_negative() == min {
                    xa
                } else {
                    xb
                }
            }
            _ => {
                if (a < b) == min {
                    xa
                } else {
                    xb
                }
            }
        }
    }
    let mut cases = Vec::new();
    for (op, min) in [("min", true), ("max", false)] {
        let r32 = move |o: &[u64]| {
            pick(
                f32v(o[0]).into(),
                f32v(o[1]).into(),
                o[0],
                o[1],
                min,
                0x7fff_ffff,
            )
        };
        let r64 = move |o: &[u64]| {
            let (a, b) = (f64::from_bits(o[0]), f64::from_bits(o[1]));
            pick(a, b, o[0], o[1], min, 0x7fff_ffff_ffff_ffff)
        };
        for (inst, ty, r) in [
            (format!("{op}.f32"), "f32", Box::new(r32) as Reference),
            (format!("{op}.f64"), "f64", Box::new(r64)),
        ] {
            cases.push(Case {
                inst,
                dst: ty,
                srcs: vec![ty; 2],
                reference: r,
                nan_any: false,
                imm: String::new(),
                body: None,
            });
        }
    }
    let flush = |v: f32| {
        if v.is_subnormal() {
            0.0f32.copysign(v)
        } else {
            v
        }
    };
    cases.push(float_case(
        "add.ftz.f32".into(),
        "f32",
        2,
        Box::new(move |o| bits32(flush(flush(f32v(o[0])) + flush(f32v(o[1]))))),
    ));
    cases.push(float_case(
        "mul.rn.ftz.f32".into(),
        "f32",
        2,
        Box::new(move |o| bits32(flush(flush(f32v(o[0])) * flush(f32v(o[1]))))),
    ));
    cases.push(float_case(
        "add.sat.f32".into(),
        "f32",
        2,
        Box::new(|o| {
            let r = f32v(o[0]) + f32v(o[1]);
            bits32(if r.is_nan() { 0.0 } else { r.clamp(0.0, 1.0) })
        }),
    ));
    cases.push(Case {
        inst: "neg.f32".into(),
        dst: "f32",
        srcs: vec!["f32"],
        reference: Box::new(|o| o[0] ^ 0x8000_0000),
        nan_any: false,
        imm: String::new(),
        body: None,
    });
    cases.push(Case {
        inst: "abs.f64".into(),
        dst: "f64",
        srcs: vec!["f64"],
        reference: Box::new(|o| o[0] & !(1 << 63)),
        nan_any: false,
        imm: String::new(),
        body: None,
    });
    cases.push(Case {
        inst: "copysign.f32".into(),
        dst: "f32",
        srcs: vec!["f32"; 2],
        reference: Box::new(|o| (o[1] & 0x7fff_ffff) | (o[0] & 0x8000_0000)),
        nan_any: false,
        imm: String::new(),
        body: None,
    });
    cases
}

/// An integer operation on two operands of a width, in i128.
type IntOp = fn(i128, i128, u32) -> i128;

fn sext(v: u64, bits: u32) -> i128 {
    let s = 128 - bits;
    (i128::from(v) << s) >> s
}

/// Integer instructions over every width they take, from the ISA's definitions in i128.
fn int_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for bits in [16u32, 32, 64] {
        for signed in [false, true] {
            let t: &'static str = match (signed, bits) {
                (false, 16) => "u16",
                (false, 32) => "u32",
                (false, _) => "u64",
                (true, 16) => "s16",
                (true, 32) => "s32",
                (true, _) => "s64",
            };
            let val = move |v: u64| {
                if signed {
                    sext(v, bits)
                } else {
                    i128::from(v) & ((1i128 << bits) - 1)
                }
            };
            let ops: [(&str, IntOp); 7] = [
                ("add", |a, b, _| a + b),
                ("sub", |a, b, _| a - b),
                ("mul.lo", |a, b, _| a.wrapping_mul(b)),
                ("mul.hi", |a, b, bits| a.wrapping_mul(b) >> bits),
                ("min", |a, b, _| a.min(b)),
                ("max", |a, b, _| a.max(b)),
                ("div", |a, b, _| if b == 0 { -1 } else { a / b }),
            ];
            for (op, f) in ops {
                if op == "div" && signed {
                    continue;
                }
                cases.push(Case {
                    inst: format!("{op}.{t}"),
                    dst: t,
                    srcs: vec![t; 2],
                    reference: Box::new(move |o| f(val(o[0]), val(o[1]), bits) as u64),
                    nan_any: false,
                    imm: String::new(),
                    body: None,
                });
            }
            let shr: Reference = Box::new(move |o| {
                let n = o[1] & 0xffff_ffff;
                let a = val(o[0]);
                if n >= u64::from(bits) {
                    (if a < 0 { -1 } else { 0 }) as u64
                } else {
                    (a >> n) as u64
                }
            });
            cases.push(Case {
                inst: format!("shr.{t}"),
                dst: t,
                srcs: vec![t, "u32"],
                reference: shr,
                nan_any: false,
                imm: String::new(),
                body: None,
            });
        }
        let b: &'static str = match bits {
            16 => "b16",
            32 => "b32",
            _ => "b64",
        };
        cases.push(Case {
            inst: format!("shl.{b}"),
            dst: b,
            srcs: vec![b, "u32"],
            reference: Box::new(move |o| {
                let n = o[1] & 0xffff_ffff;
                if n >= u64::from(bits) { 0 } else { o[0] << n }
            }),
            nan_any: false,
            imm: String::new(),
            body: None,
        });
        if bits >= 32 {
            for (op, f) in [
                (
                    "popc",
                    (|v: u64, _: u32| u64::from(v.count_ones())) as fn(u64, u32) -> u64,
                ),
                ("clz", |v, bits| u64::from(v.leading_zeros() - (64 - bits))),
                ("brev", |v, bits| v.reverse_bits() >> (64 - bits)),
            ] {
                // popc and clz write a .u32 whatever their operand's width.
                let dst = if op == "brev" { b } else { "u32" };
                cases.push(Case {
                    inst: format!("{op}.{b}"),
                    dst,
                    srcs: vec![b],
                    reference: Box::new(move |o| f(o[0], bits)),
                    nan_any: false,
                    imm: String::new(),
                    body: None,
                });
            }
        }
    }
    cases.push(Case {
        inst: "add.sat.s32".into(),
        dst: "s32",
        srcs: vec!["s32"; 2],
        reference: Box::new(|o| {
            (sext(o[0], 32) + sext(o[1], 32)).clamp(i32::MIN.into(), i32::MAX.into()) as u64
        }),
        nan_any: false,
        imm: String::new(),
        body: None,
    });
    cases.push(Case {
        inst: "mul.wide.s32".into(),
        dst: "s64",
        srcs: vec!["s32"; 2],
        reference: Box::new(|o| (sext(o[0], 32) * sext(o[1], 32)) as u64),
        nan_any: false,
        imm: String::new(),
        body: None,
    });
    cases
}

/// Conversions: float to integer in each integer rounding (saturating, NaN to 0), integer
/// to float and f64 to f32 in each rounding.
fn cvt_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (irnd, f) in [
        ("rni", f64::round_ties_even as fn(f64) -> f64),
        ("rzi", f64::trunc),
        ("rmi", f64::floor),
        ("rpi", f64::ceil),
    ] {
        for (t, lo, hi) in [
            ("s32", i128::from(i32::MIN), i128::from(i32::MAX)),
            ("u32", 0, i128::from(u32::MAX)),
            ("s64", i128::from(i64::MIN), i128::from(i64::MAX)),
        ] {
            for src in ["f32", "f64"] {
                cases.push(Case {
                    inst: format!("cvt.{irnd}.{t}.{src}"),
                    dst: t,
                    srcs: vec![src],
                    reference: Box::new(move |o| {
                        let v = if src == "f32" {
                            f64::from(f32v(o[0]))
                        } else {
                            f64::from_bits(o[0])
                        };
                        if v.is_nan() {
                            return 0;
                        }
                        // Saturation is a comparison; the rounded value is exact in f64.
                        let r = f(v);
                        (if r <= lo as f64 {
                            lo
                        } else if r >= hi as f64 {
                            hi
                        } else {
                            r as i128
                        }) as u64
                    }),
                    nan_any: false,
                    imm: String::new(),
                    body: None,
                });
            }
        }
    }
    for (mode, m) in MODES {
        cases.push(float_case(
            format!("cvt.{m}.f32.f64"),
            "f32",
            1,
            Box::new(move |o| {
                let a = f64::from_bits(o[0]);
                bits32(round32(a as f32, &[term(a, false)], a.is_finite(), mode))
            }),
        ));
        cases.last_mut().unwrap().srcs = vec!["f64"];
        for (src, bits) in [("s64", 64), ("u64", 64), ("s32", 32)] {
            let signed = src.starts_with('s');
            let value = move |v: u64| {
                if signed { sext(v, bits) } else { i128::from(v) }
            };
            let as_term = |v: i128| -> Term { (v < 0, v.unsigned_abs(), 0) };
            cases.push(Case {
                inst: format!("cvt.{m}.f32.{src}"),
                dst: "f32",
                srcs: vec![src],
                reference: Box::new(move |o| {
                    let v = value(o[0]);
                    bits32(round32(v as f32, &[as_term(v)], true, mode))
                }),
                nan_any: false,
                imm: String::new(),
                body: None,
            });
            cases.push(Case {
                inst: format!("cvt.{m}.f64.{src}"),
                dst: "f64",
                srcs: vec![src],
                reference: Box::new(move |o| {
                    let v = value(o[0]);
                    round64(v as f64, &[as_term(v)], true, mode).to_bits()
                }),
                nan_any: false,
                imm: String::new(),
                body: None,
            });
        }
    }
    cases
}

/// A case of `b32` operands.
fn b32_case(inst: String, n: usize, imm: &str, reference: Reference) -> Case {
    Case {
        inst,
        dst: "b32",
        srcs: vec!["b32"; n],
        reference,
        nan_any: false,
        imm: imm.into(),
        body: None,
    }
}

/// The bit instructions: `lop3` for several tables, funnel shifts, `bfind`, `bmsk`, every
/// `prmt` mode, `testp` classes and the dot products, each from the ISA's definition.
fn bit_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for lut in [0x96u64, 0xe8, 0xf8, 0x1e, 0x80, 0x01, 0xca] {
        cases.push(b32_case(
            "lop3.b32".into(),
            3,
            &format!(", {lut:#x}"),
            Box::new(move |o| {
                // The sum of the minterms the table selects (bit i: a, b, c = i's bits 2, 1, 0).
                (0..8u64)
                    .filter(|i| lut >> i & 1 == 1)
                    .map(|i| {
                        let pick = |v: u64, bit: u64| if i >> bit & 1 == 1 { v } else { !v };
                        pick(o[0], 2) & pick(o[1], 1) & pick(o[2], 0)
                    })
                    .fold(0, |x, y| x | y)
            }),
        ));
    }
    for (dir, left) in [("l", true), ("r", false)] {
        for (mode, clamp) in [("clamp", true), ("wrap", false)] {
            cases.push(b32_case(
                format!("shf.{dir}.{mode}.b32"),
                3,
                "",
                Box::new(move |o| {
                    let n = if clamp {
                        (o[2] & 0xffff_ffff).min(32)
                    } else {
                        o[2] & 31
                    };
                    let wide =
                        u128::from(o[1] & 0xffff_ffff) << 32 | u128::from(o[0] & 0xffff_ffff);
                    (if left { (wide << n) >> 32 } else { wide >> n }) as u64
                }),
            ));
        }
    }
    for (t, bits, signed) in [
        ("u32", 32u32, false),
        ("s32", 32, true),
        ("u64", 64, false),
        ("s64", 64, true),
    ] {
        for shiftamt in [false, true] {
            cases.push(Case {
                inst: format!("bfind{}.{t}", if shiftamt { ".shiftamt" } else { "" }),
                dst: "u32",
                srcs: vec![t],
                reference: Box::new(move |o| {
                    let v = if signed {
                        sext(o[0], bits)
                    } else {
                        i128::from(o[0])
                    };
                    let v = if v < 0 { !v } else { v };
                    match (0..bits).rev().find(|&i| v >> i & 1 == 1) {
                        None => 0xffff_ffff,
                        Some(p) if shiftamt => u64::from(bits - 1 - p),
                        Some(p) => u64::from(p),
                    }
                }),
                nan_any: false,
                imm: String::new(),
                body: None,
            });
        }
    }
    for (mode, clamp) in [("clamp", true), ("wrap", false)] {
        cases.push(b32_case(
            format!("bmsk.{mode}.b32"),
            2,
            "",
            Box::new(move |o| {
                let lim = |v: u64| {
                    if clamp {
                        (v & 0xffff_ffff).min(32)
                    } else {
                        v & 31
                    }
                };
                (lim(o[0])..lim(o[0]) + lim(o[1]))
                    .filter(|&i| i < 32)
                    .map(|i| 1u64 << i)
                    .sum()
            }),
        ));
    }
    // The ISA's table: for each mode and selector, the sources of d.b3, d.b2, d.b1, d.b0.
    let table: [(&str, [[u64; 4]; 4]); 6] = [
        (
            "f4e",
            [[3, 2, 1, 0], [4, 3, 2, 1], [5, 4, 3, 2], [6, 5, 4, 3]],
        ),
        (
            "b4e",
            [[5, 6, 7, 0], [6, 7, 0, 1], [7, 0, 1, 2], [0, 1, 2, 3]],
        ),
        (
            "rc8",
            [[0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]],
        ),
        (
            "ecl",
            [[3, 2, 1, 0], [3, 2, 1, 1], [3, 2, 2, 2], [3, 3, 3, 3]],
        ),
        (
            "ecr",
            [[0, 0, 0, 0], [1, 1, 1, 0], [2, 2, 1, 0], [3, 2, 1, 0]],
        ),
        (
            "rc16",
            [[1, 0, 1, 0], [3, 2, 3, 2], [1, 0, 1, 0], [3, 2, 3, 2]],
        ),
    ];
    for (mode, rows) in table {
        cases.push(b32_case(
            format!("prmt.b32.{mode}"),
            3,
            "",
            Box::new(move |o| {
                let pool = (o[1] & 0xffff_ffff) << 32 | (o[0] & 0xffff_ffff);
                let row = rows[(o[2] & 3) as usize];
                (0..4)
                    .map(|i| (pool >> (8 * row[3 - i]) & 0xff) << (8 * i))
                    .sum()
            }),
        ));
    }
    for class in [
        "finite",
        "infinite",
        "number",
        "notanumber",
        "normal",
        "subnormal",
    ] {
        for t in ["f32", "f64"] {
            cases.push(Case {
                inst: format!("testp.{class}.{t}"),
                dst: "pred",
                srcs: vec![t],
                reference: Box::new(move |o| {
                    let (exp, frac, expmax) = if t == "f32" {
                        ((o[0] >> 23) & 0xff, o[0] & 0x7f_ffff, 0xff)
                    } else {
                        ((o[0] >> 52) & 0x7ff, o[0] & ((1 << 52) - 1), 0x7ff)
                    };
                    u64::from(match class {
                        "finite" => exp != expmax,
                        "infinite" => exp == expmax && frac == 0,
                        "number" => !(exp == expmax && frac != 0),
                        "notanumber" => exp == expmax && frac != 0,
                        "normal" => exp != 0 && exp != expmax,
                        _ => exp == 0 && frac != 0,
                    })
                }),
                nan_any: false,
                imm: String::new(),
                body: None,
            });
        }
    }
    for (ta, tb) in [
        ("u32", "u32"),
        ("s32", "s32"),
        ("u32", "s32"),
        ("s32", "u32"),
    ] {
        let ext = |v: u64, at: u64, width: u64, signed: bool| {
            let x = (v >> at) & ((1 << width) - 1);
            if signed {
                sext(x, width as u32)
            } else {
                i128::from(x)
            }
        };
        let (sa, sb) = (ta == "s32", tb == "s32");
        cases.push(b32_case(
            format!("dp4a.{ta}.{tb}"),
            3,
            "",
            Box::new(move |o| {
                let dot: i128 = (0..4)
                    .map(|i| ext(o[0], 8 * i, 8, sa) * ext(o[1], 8 * i, 8, sb))
                    .sum();
                (i128::from(o[2]) + dot) as u64
            }),
        ));
        for (half, base) in [("lo", 0), ("hi", 16)] {
            cases.push(b32_case(
                format!("dp2a.{half}.{ta}.{tb}"),
                3,
                "",
                Box::new(move |o| {
                    let dot = ext(o[0], 0, 16, sa) * ext(o[1], base, 8, sb)
                        + ext(o[0], 16, 16, sa) * ext(o[1], base + 8, 8, sb);
                    (i128::from(o[2]) + dot) as u64
                }),
            ));
        }
    }
    cases
}

/// A carry instruction's reference: the result and the carry out.
type CarryRef = std::rc::Rc<dyn Fn(&[u64]) -> (u128, bool)>;

/// Extended-precision arithmetic: each instruction with the carry flag set by a first
/// `add.cc` (to `c`'s top bit), and each `.cc` form's carry read back by an `addc` of zeros.
fn carry_cases() -> Vec<Case> {
    use std::rc::Rc;
    let mut cases = Vec::new();
    for (t, bits, signed) in [
        ("u32", 32u32, false),
        ("s32", 32, true),
        ("u64", 64, false),
        ("s64", 64, true),
    ] {
        let mask = if bits == 64 {
            u128::from(u64::MAX)
        } else {
            (1 << bits) - 1
        };
        let cf = move |c: u64| u128::from(c >> (bits - 1) & 1);
        let mad = move |a: u64, b: u64, hi: bool| -> u128 {
            let p = if signed {
                (sext(a, bits) * sext(b, bits)) as u128
            } else {
                u128::from(a) * u128::from(b)
            };
            (if hi { p >> bits } else { p }) & mask
        };
        let u = move |v: u64| u128::from(v) & mask;
        let ops: Vec<(&str, &str, CarryRef)> = vec![
            (
                "addc",
                "%a, %b",
                Rc::new(move |o| {
                    let s = u(o[0]) + u(o[1]) + cf(o[2]);
                    (s & mask, s > mask)
                }),
            ),
            (
                "subc",
                "%a, %b",
                Rc::new(move |o| {
                    let (x, y) = (u(o[0]), u(o[1]) + cf(o[2]));
                    (x.wrapping_sub(y) & mask, x < y)
                }),
            ),
            (
                "madc.lo",
                "%a, %b, %c",
                Rc::new(move |o| {
                    let s = mad(o[0], o[1], false) + u(o[2]) + cf(o[2]);
                    (s & mask, s > mask)
                }),
            ),
            (
                "madc.hi",
                "%a, %b, %c",
                Rc::new(move |o| {
                    let s = mad(o[0], o[1], true) + u(o[2]) + cf(o[2]);
                    (s & mask, s > mask)
                }),
            ),
        ];
        for (name, args, f) in ops {
            let g = f.clone();
            let set = format!("add.cc.{t} %d, %c, %c;\n");
            cases.push(Case {
                inst: format!("{name}.{t}"),
                dst: t,
                srcs: vec![t; 3],
                reference: Box::new(move |o| f(o).0 as u64),
                nan_any: false,
                imm: String::new(),
                body: Some(format!("{set}{name}.{t} %d, {args};")),
            });
            cases.push(Case {
                inst: format!("{name}.cc.{t}"),
                dst: t,
                srcs: vec![t; 3],
                reference: Box::new(move |o| u64::from(g(o).1)),
                nan_any: false,
                imm: String::new(),
                body: Some(format!(
                    "{set}{name}.cc.{t} %d, {args};\naddc.{t} %d, 0, 0;"
                )),
            });
        }
        for (name, args) in [
            ("add.cc", "%a, %b"),
            ("sub.cc", "%a, %b"),
            ("mad.lo.cc", "%a, %b, %c"),
            ("mad.hi.cc", "%a, %b, %c"),
        ] {
            let r: CarryRef = match name {
                "add.cc" => Rc::new(move |o| {
                    let s = u(o[0]) + u(o[1]);
                    (s & mask, s > mask)
                }),
                "sub.cc" => {
                    Rc::new(move |o| (u(o[0]).wrapping_sub(u(o[1])) & mask, u(o[0]) < u(o[1])))
                }
                "mad.lo.cc" => Rc::new(move |o| {
                    let s = mad(o[0], o[1], false) + u(o[2]);
                    (s & mask, s > mask)
                }),
                _ => Rc::new(move |o| {
                    let s = mad(o[0], o[1], true) + u(o[2]);
                    (s & mask, s > mask)
                }),
            };
            cases.push(Case {
                inst: format!("{name}.{t}"),
                dst: t,
                srcs: vec![t; 3],
                reference: Box::new(move |o| {
                    let (v, c) = r(o);
                    // d keeps the sum, the next addc adds the carry to it.
                    ((v + u128::from(c)) & mask) as u64
                }),
                nan_any: false,
                imm: String::new(),
                body: Some(format!("{name}.{t} %d, {args};\naddc.{t} %d, %d, 0;")),
            });
        }
    }
    cases
}

// ---- half precision, from IEEE 754 binary16 ----

fn f16_edges() -> Vec<u64> {
    vec![
        0x0000, 0x8000, 0x3c00, 0xbc00, 0x3c01, 0x3bff, 0x4200,
        0x2e66, // 0, 1, 1±ulp, 3, 0.1
        0x0001, 0x8001, 0x03ff, 0x0400, 0x8400, // subnormals and the least normals
        0x7bff, 0xfbff, 0x7c00, 0xfc00, 0x7e00, 0xfd01, 0x7c01, // max, ±inf, NaNs
        0x6bff, 0x1400, // 4095 (ties when added), 2^-10
    ]
}

/// A binary16's value from its fields (exact in f64).
fn f16v(h: u16) -> f64 {
    let e = i32::from((h >> 10) & 0x1f);
    let f = f64::from(h & 0x3ff);
    let v = match e {
        0 => f * 2f64.powi(-24),
        31 if f == 0.0 => f64::INFINITY,
        31 => f64::NAN,
        _ => (1.0 + f / 1024.0) * 2f64.powi(e - 15),
    };
    if h & 0x8000 != 0 { -v } else { v }
}

/// Rounds a value to binary16 by search: `cmp(t)` orders the exact magnitude against `t`.
/// The neighbours of the magnitude are found among the ascending positive encodings
/// (+inf standing for 2^16, where rounding to nearest overflows), then chosen by `mode`.
fn round_f16_ref(neg: bool, cmp: &dyn Fn(f64) -> Ordering, mode: Mode) -> u16 {
    let value = |k: u16| if k == 0x7c00 { 65536.0 } else { f16v(k) };
    let (mut lo, mut hi) = (0u16, 0x7c00u16);
    if cmp(65536.0) != Ordering::Less {
        lo = 0x7c00;
    } else {
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if cmp(value(mid)) == Ordering::Less {
                hi = mid;
            } else {
                lo = mid;
            }
        }
    }
    let away = match mode {
        Mode::Rn => false,
        Mode::Rz => false,
        Mode::Rm => neg,
        Mode::Rp => !neg,
    };
    let k = if lo == 0x7c00 {
        if matches!(mode, Mode::Rn) || away {
            0x7c00
        } else {
            0x7bff
        }
    } else if cmp(value(lo)) == Ordering::Equal {
        lo
    } else if matches!(mode, Mode::Rn) {
        match cmp((value(lo) + value(lo + 1)) / 2.0) {
            Ordering::Less => lo,
            Ordering::Greater => lo + 1,
            Ordering::Equal => {
                if lo & 1 == 0 {
                    lo
                } else {
                    lo + 1
                }
            }
        }
    } else if away {
        lo + 1
    } else {
        lo
    };
    k | if neg { 0x8000 } else { 0 }
}

/// A finite binary16 exactly as a count of 2^-24, its least subnormal.
fn f16_units24(h: u16) -> i128 {
    (f16v(h) * 2f64.powi(24)) as i128
}

/// `a*b + c` (`c` absent: `a*b`; `b` absent: `a + c`) in binary16, from its definition:
/// special values through f64's IEEE arithmetic, the rest from the exact sum.
fn f16_arith_ref(a: u16, b: Option<u16>, c: Option<u16>, ftz: bool, sat: bool) -> u16 {
    let flush = |h: u16| {
        if ftz && h & 0x7c00 == 0 {
            h & 0x8000
        } else {
            h
        }
    };
    let (a, b, c) = (flush(a), b.map(flush), c.map(flush));
    let (fa, fb, fc) = (f16v(a), b.map(f16v), c.map(f16v));
    let f = match (fb, fc) {
        (Some(fb), Some(fc)) => fa.mul_add(fb, fc),
        (Some(fb), None) => fa * fb,
        (None, Some(fc)) => fa + fc,
        (None, None) => unreachable!("an operation has two operands"),
    };
    let r = if f.is_nan() {
        0x7fff
    } else if f.is_infinite()
        && !(fa.is_finite() && fb.is_none_or(f64::is_finite) && fc.is_none_or(f64::is_finite))
    {
        if f < 0.0 { 0xfc00 } else { 0x7c00 }
    } else {
        let prod = match b {
            Some(b) => f16_units24(a) * f16_units24(b),
            None => f16_units24(a) << 24,
        };
        let exact = prod + c.map_or(0, |c| f16_units24(c) << 24);
        if exact == 0 {
            if f.is_sign_negative() { 0x8000 } else { 0 }
        } else {
            let mag = exact.unsigned_abs();
            let cmp = move |t: f64| mag.cmp(&((t * 2f64.powi(48)) as u128));
            round_f16_ref(exact < 0, &cmp, Mode::Rn)
        }
    };
    let r = flush(r);
    if !sat {
        r
    } else if r & 0x7fff > 0x7c00 || r & 0x8000 != 0 {
        0
    } else if f16v(r) > 1.0 {
        0x3c00
    } else {
        r
    }
}

/// Applies a binary16 reference to one half, or to both halves of an f16x2.
fn per_half(ty: &'static str, f: impl Fn(&[u16]) -> u16 + 'static) -> Reference {
    Box::new(move |o| {
        let lane = |shift: u32| {
            u64::from(f(&o
                .iter()
                .map(|&x| (x >> shift) as u16)
                .collect::<Vec<_>>()))
        };
        if ty == "f16x2" {
            lane(0) | lane(16) << 16
        } else {
            lane(0)
        }
    })
}

fn half_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for ty in ["f16", "f16x2"] {
        for (ftz, sat) in [(false, false), (true, false), (false, true), (true, true)] {
            let m = format!(
                "{}{}",
                if ftz { ".ftz" } else { "" },
                if sat { ".sat" } else { "" }
            );
            cases.push(float_case(
                format!("add.rn{m}.{ty}"),
                ty,
                2,
                per_half(ty, move |o| f16_arith_ref(o[0], None, Some(o[1]), ftz, sat)),
            ));
            cases.push(float_case(
                format!("sub{m}.{ty}"),
                ty,
                2,
                per_half(ty, move |o| {
                    f16_arith_ref(o[0], None, Some(o[1] ^ 0x8000), ftz, sat)
                }),
            ));
            cases.push(float_case(
                format!("mul{m}.{ty}"),
                ty,
                2,
                per_half(ty, move |o| f16_arith_ref(o[0], Some(o[1]), None, ftz, sat)),
            ));
            cases.push(float_case(
                format!("fma.rn{m}.{ty}"),
                ty,
                3,
                per_half(ty, move |o| {
                    f16_arith_ref(o[0], Some(o[1]), Some(o[2]), ftz, sat)
                }),
            ));
        }
        for ftz in [false, true] {
            let m = if ftz { ".ftz" } else { "" };
            let flush = move |h: u16| {
                if ftz && h & 0x7c00 == 0 {
                    h & 0x8000
                } else {
                    h
                }
            };
            cases.push(float_case(
                format!("neg{m}.{ty}"),
                ty,
                1,
                per_half(ty, move |o| flush(o[0]) ^ 0x8000),
            ));
            cases.push(float_case(
                format!("abs{m}.{ty}"),
                ty,
                1,
                per_half(ty, move |o| flush(o[0]) & 0x7fff),
            ));
        }
    }
    for (cmp, f) in [
        ("eq", (|a: f64, b: f64| a == b) as fn(f64, f64) -> bool),
        ("ne", |a, b| a != b && !a.is_nan() && !b.is_nan()),
        ("lt", |a, b| a < b),
        ("ge", |a, b| a >= b),
        ("gtu", |a, b| a > b || a.is_nan() || b.is_nan()),
        ("equ", |a, b| a == b || a.is_nan() || b.is_nan()),
        ("num", |a, b| !a.is_nan() && !b.is_nan()),
        ("nan", |a, b| a.is_nan() || b.is_nan()),
    ] {
        cases.push(Case {
            inst: format!("setp.{cmp}.f16"),
            dst: "pred",
            srcs: vec!["f16", "f16"],
            reference: Box::new(move |o| u64::from(f(f16v(o[0] as u16), f16v(o[1] as u16)))),
            nan_any: false,
            imm: String::new(),
            body: None,
        });
    }
    for (mode, m) in MODES {
        for src in ["f32", "f64"] {
            cases.push(Case {
                inst: format!("cvt.{m}.f16.{src}"),
                dst: "f16",
                srcs: vec![src],
                reference: Box::new(move |o| {
                    let v = if src == "f32" {
                        f64::from(f32v(o[0]))
                    } else {
                        f64::from_bits(o[0])
                    };
                    u64::from(if v.is_nan() {
                        0x7fff
                    } else if v.is_infinite() {
                        // Infinity converts exactly, in every mode.
                        if v < 0.0 { 0xfc00 } else { 0x7c00 }
                    } else if v == 0.0 {
                        if v.is_sign_negative() { 0x8000 } else { 0 }
                    } else {
                        let mag = v.abs();
                        round_f16_ref(v < 0.0, &move |t: f64| mag.total_cmp(&t), mode)
                    })
                }),
                nan_any: true,
                imm: String::new(),
                body: None,
            });
        }
        cases.push(Case {
            inst: format!("cvt.{m}.f16.s32"),
            dst: "f16",
            srcs: vec!["s32"],
            reference: Box::new(move |o| {
                let v = f64::from(o[0] as u32 as i32);
                u64::from(if v == 0.0 {
                    0
                } else {
                    let mag = v.abs();
                    round_f16_ref(v < 0.0, &move |t: f64| mag.total_cmp(&t), mode)
                })
            }),
            nan_any: false,
            imm: String::new(),
            body: None,
        });
    }
    for (dst, widen) in [
        (
            "f32",
            (|v: f64| u64::from((v as f32).to_bits())) as fn(f64) -> u64,
        ),
        ("f64", |v: f64| v.to_bits()),
    ] {
        cases.push(Case {
            inst: format!("cvt.{dst}.f16"),
            dst,
            srcs: vec!["f16"],
            reference: Box::new(move |o| widen(f16v(o[0] as u16))),
            nan_any: true,
            imm: String::new(),
            body: None,
        });
    }
    cases.push(Case {
        inst: "cvt.rni.s32.f16".into(),
        dst: "s32",
        srcs: vec!["f16"],
        reference: Box::new(|o| {
            let v = f16v(o[0] as u16);
            if v.is_nan() {
                0
            } else {
                v.round_ties_even()
                    .clamp(f64::from(i32::MIN), f64::from(i32::MAX)) as i32 as u32
                    as u64
            }
        }),
        nan_any: false,
        imm: String::new(),
        body: None,
    });
    cases
}

#[test]
fn conformance_half_precision() {
    check(half_cases());
}

/// Half-precision forms sm_75 lacks are refused naming the target that has them.
#[test]
fn half_precision_past_sm75_is_refused_by_name() {
    for (inst, named) in [
        ("add.rn.bf16 %h, %h, %h;", "bf16 needs sm_80"),
        ("fma.rn.relu.f16 %h, %h, %h, %h;", "relu needs sm_80"),
        ("cvt.rn.f16x2.f32 %r, %f, %f;", "f16x2.f32 needs sm_80"),
        ("min.f16 %h, %h, %h;", "min.f16 needs sm_80"),
        ("add.rz.f16 %h, %h, %h;", "add.rz on half precision"),
        ("fma.f16 %h, %h, %h, %h;", "needs .rn"),
        ("mad.f16 %h, %h, %h, %h;", "mad.f16 is not supported"),
        ("setp.eq.f16x2 %p|%q, %r, %r;", "setp.f16x2"),
    ] {
        let ptx = format!(
            ".visible .entry k()\n{{\n.reg .f16 %h;\n.reg .b32 %r;\n.reg .f32 %f;\n\
             .reg .pred %p, %q;\n{inst}\nret;\n}}\n"
        );
        let e = Module::parse(&format!(
            ".version 8.5\n.target sm_75\n.address_size 64\n{ptx}"
        ))
        .expect_err(inst);
        assert!(e.to_string().contains(named), "{inst}: {e}");
    }
}

/// `mul24`/`mad24` (.lo, .hi, `mad24.hi.sat.s32`) and `sad`, from the ISA's definitions:
/// the 48-bit product of the operands' low 24 bits (sign-extended for .s32), its bits 31..0
/// or 47..16, plus the addend; `sad` adds |a - b| to c, modulo the width.
fn mul24_sad_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for signed in [false, true] {
        let t: &'static str = if signed { "s32" } else { "u32" };
        let v24 = move |x: u64| {
            if signed {
                sext(x & 0xff_ffff, 24)
            } else {
                i128::from(x & 0xff_ffff)
            }
        };
        for (half, shift) in [("lo", 0), ("hi", 16)] {
            for (base, n) in [("mul24", 2), ("mad24", 3)] {
                cases.push(Case {
                    inst: format!("{base}.{half}.{t}"),
                    dst: t,
                    srcs: vec![t; n],
                    reference: Box::new(move |o| {
                        let part = (v24(o[0]) * v24(o[1])) >> shift;
                        (part + o.get(2).map_or(0, |&c| i128::from(c))) as u64
                    }),
                    nan_any: false,
                    imm: String::new(),
                    body: None,
                });
            }
        }
    }
    cases.push(Case {
        inst: "mad24.hi.sat.s32".into(),
        dst: "s32",
        srcs: vec!["s32"; 3],
        reference: Box::new(|o| {
            let v24 = |x: u64| sext(x & 0xff_ffff, 24);
            let r = ((v24(o[0]) * v24(o[1])) >> 16) + sext(o[2], 32);
            r.clamp(i128::from(i32::MIN), i128::from(i32::MAX)) as u64
        }),
        nan_any: false,
        imm: String::new(),
        body: None,
    });
    for t in ["u16", "u32", "u64", "s16", "s32", "s64"] {
        let bits: u32 = t[1..].parse().unwrap();
        let val = move |x: u64| {
            if t.starts_with('s') {
                sext(x, bits)
            } else {
                i128::from(x) & ((1i128 << bits) - 1)
            }
        };
        cases.push(Case {
            inst: format!("sad.{t}"),
            dst: t,
            srcs: vec![t; 3],
            reference: Box::new(move |o| ((val(o[0]) - val(o[1])).abs() + i128::from(o[2])) as u64),
            nan_any: false,
            imm: String::new(),
            body: None,
        });
    }
    cases
}

/// `slct`: the first operand where the selector is at least zero (-0.0 is; a NaN is not;
/// `.ftz` makes a subnormal selector zero), else the second.
fn slct_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for t in ["b32", "u64", "f64", "s16"] {
        for (cty, ftz) in [("s32", false), ("f32", false), ("f32", true)] {
            let m = if ftz { ".ftz" } else { "" };
            cases.push(Case {
                inst: format!("slct{m}.{t}.{cty}"),
                dst: t,
                srcs: vec![t, t, cty],
                reference: Box::new(move |o| {
                    let c = o[2] as u32;
                    let first = if cty == "s32" {
                        c as i32 >= 0
                    } else {
                        let subnormal = c & 0x7f80_0000 == 0;
                        let f = if ftz && subnormal {
                            0.0
                        } else {
                            f32::from_bits(c)
                        };
                        f >= 0.0
                    };
                    if first { o[0] } else { o[1] }
                }),
                nan_any: false,
                imm: String::new(),
                body: None,
            });
        }
    }
    cases
}

/// `set`: a comparison written as all ones (`.u32`, `.s32`) or 1.0 (`.f32`) for true, 0 for
/// false, optionally combined with a (negated) predicate.
fn set_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (dty, one) in [("u32", 0xffff_ffffu64), ("f32", 0x3f80_0000)] {
        for (sty, value) in [
            (
                "s32",
                (|v: u64| f64::from(v as u32 as i32)) as fn(u64) -> f64,
            ),
            ("u64", |v: u64| v as f64),
            ("f32", |v: u64| f64::from(f32::from_bits(v as u32))),
            ("f64", f64::from_bits),
        ] {
            // u64 operands are compared exactly: as f64 two may round together, so compare them
            // as integers.
            for (cmp, f) in [
                (
                    "lt",
                    (|o: Ordering| o == Ordering::Less) as fn(Ordering) -> bool,
                ),
                ("ge", |o| o != Ordering::Less),
                ("ne", |o| o != Ordering::Equal),
            ] {
                cases.push(Case {
                    inst: format!("set.{cmp}.{dty}.{sty}"),
                    dst: dty,
                    srcs: vec![sty, sty],
                    reference: Box::new(move |o| {
                        let order = if sty == "u64" {
                            Some(o[0].cmp(&o[1]))
                        } else {
                            value(o[0]).partial_cmp(&value(o[1]))
                        };
                        // An ordered comparison with a NaN is false.
                        if order.is_some_and(f) { one } else { 0 }
                    }),
                    nan_any: false,
                    imm: String::new(),
                    body: None,
                });
            }
        }
    }
    // Combined with a predicate that is true on odd lanes' first operand.
    cases.push(Case {
        inst: "set.gt.and.u32.s32".into(),
        dst: "u32",
        srcs: vec!["s32", "s32"],
        reference: Box::new(|o| {
            let c = o[0] & 1 == 0;
            if (o[0] as u32 as i32) > (o[1] as u32 as i32) && c {
                0xffff_ffff
            } else {
                0
            }
        }),
        nan_any: false,
        imm: String::new(),
        body: Some(
            "and.b32 %r2, %a, 1;\nsetp.ne.u32 %p, %r2, 0;\nset.gt.and.u32.s32 %d, %a, %b, !%p;"
                .into(),
        ),
    });
    cases
}

#[test]
fn conformance_set() {
    check(set_cases());
}

#[test]
fn conformance_slct() {
    check(slct_cases());
}

#[test]
fn conformance_mul24_mad24_sad() {
    check(mul24_sad_cases());
}

/// `mul24`/`mad24` need .lo or .hi, and saturate only as `mad24.hi.sat.s32`; `slct` takes an
/// s32 or f32 selector, `.ftz` only with the f32 one; `set` writes u32, s32 or f32.
#[test]
fn mul24_slct_and_set_forms_the_isa_lacks_are_refused() {
    for (inst, named) in [
        ("mul24.u32 %r, %r, %r;", "needs .lo or .hi"),
        ("mad24.lo.sat.s32 %r, %r, %r, %r;", "mad24.hi.sat.s32"),
        ("mul24.lo.u64 %r, %r, %r;", "mul24.u64 is not supported"),
        ("slct.b32.u32 %r, %r, %r, %r;", "does not exist"),
        (
            "slct.ftz.b32.s32 %r, %r, %r, %r;",
            ".ftz on .S32 does not exist",
        ),
        ("slct.b32.s32 %r, %r, %r;", "operand"),
        (
            "set.eq.u16.s32 %r, %r, %r;",
            "set writes .u32, .s32 or .f32",
        ),
        (
            "set.eq.u32 %r, %r, %r;",
            "set names a result and a source type",
        ),
    ] {
        let ptx = format!(
            ".version 8.5\n.target sm_75\n.address_size 64\n\
             .visible .entry k()\n{{\n.reg .b32 %r;\n{inst}\nret;\n}}\n"
        );
        let e = Module::parse(&ptx).expect_err(inst);
        assert!(e.to_string().contains(named), "{inst}: {e}");
    }
}

#[test]
fn conformance_carry_chains() {
    check(carry_cases());
}

#[test]
fn conformance_bit_instructions() {
    check(bit_cases());
}

#[test]
fn conformance_float_arithmetic_in_every_rounding_mode() {
    check(float_cases());
}

#[test]
fn conformance_float_min_max_ftz_saturation_and_signs() {
    check(float_misc_cases());
}

#[test]
fn conformance_integer_arithmetic_shifts_and_bits() {
    check(int_cases());
}

#[test]
fn conformance_conversions() {
    check(cvt_cases());
}

/// The exact reference itself: a few sums whose signs are known.
#[test]
fn conformance_reference_signs_are_exact() {
    let tiny = f64::from_bits(1);
    assert_eq!(
        exact_sign(&[term(1e300, false), term(tiny, false), term(1e300, true)]),
        Ordering::Greater
    );
    assert_eq!(
        exact_sign(&[product(3.0, 1.0 / 3.0, false), term(1.0, true)]),
        Ordering::Less
    );
    assert_eq!(
        round64(1.0, &[term(1.0, false), term(tiny, false)], true, Mode::Rp),
        1.0f64.next_up()
    );
    assert_eq!(
        round32(1.0, &[term(1.0, false), term(tiny, true)], true, Mode::Rz),
        1.0f32.next_down()
    );
}
