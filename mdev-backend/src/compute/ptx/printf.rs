//! CUDA's device-side `printf` formatting (the `vprintf` the compiler calls): C conversions
//! over an argument buffer where each argument is aligned to its own size (integers 4 or 8
//! bytes, `double` 8, pointers and strings 8).

use crate::compute::ComputeResult;

/// Where the arguments come from.
pub(crate) trait Args {
    /// The next argument of `size` bytes (4 or 8).
    fn next(&mut self, size: u64) -> ComputeResult<u64>;
    /// The NUL-terminated string at a device address (bounded by the caller).
    fn string(&mut self, addr: u64) -> ComputeResult<Vec<u8>>;
}

/// Most conversions formatted per call, bounding the work of one format string.
const MAX_CONVERSIONS: usize = 64;
/// Widest field or precision honoured.
const MAX_WIDTH: usize = 512;

#[derive(Default)]
struct Spec {
    left: bool,
    plus: bool,
    space: bool,
    zero: bool,
    alt: bool,
    width: usize,
    precision: Option<usize>,
    long: bool,
}

/// Formats `fmt` with arguments from `args`.
pub(crate) fn format(fmt: &[u8], args: &mut dyn Args) -> ComputeResult<String> {
    let mut out = String::new();
    let mut i = 0;
    let mut conversions = 0;
    while i < fmt.len() {
        let c = fmt[i];
        i += 1;
        if c != b'%' {
            out.push(char::from(c));
            continue;
        }
        let mut spec = Spec::default();
        while let Some(&f) = fmt.get(i) {
            match f {
                b'-' => spec.left = true,
                b'+' => spec.plus = true,
                b' ' => spec.space = true,
                b'0' => spec.zero = true,
                b'#' => spec.alt = true,
                _ => break,
            }
            i += 1;
        }
        while let Some(d) = fmt.get(i).filter(|d| d.is_ascii_digit()) {
            spec.width = (spec.width * 10 + usize::from(d - b'0')).min(MAX_WIDTH);
            i += 1;
        }
        if fmt.get(i) == Some(&b'.') {
            i += 1;
            let mut p = 0;
            while let Some(d) = fmt.get(i).filter(|d| d.is_ascii_digit()) {
                p = (p * 10 + usize::from(d - b'0')).min(MAX_WIDTH);
                i += 1;
            }
            spec.precision = Some(p);
        }
        while let Some(&m) = fmt.get(i) {
            match m {
                b'l' | b'z' | b'j' | b't' | b'L' => spec.long = true,
                b'h' => {}
                _ => break,
            }
            i += 1;
        }
        let Some(&conv) = fmt.get(i) else {
            out.push('%');
            break;
        };
        i += 1;
        if conv == b'%' {
            out.push('%');
            continue;
        }
        conversions += 1;
        if conversions > MAX_CONVERSIONS {
            out.push_str("<printf: too many conversions>");
            break;
        }
        let int_size = if spec.long { 8 } else { 4 };
        let body = match conv {
            b'd' | b'i' => {
                let v = args.next(int_size)?;
                let v = if spec.long {
                    v as i64
                } else {
                    i64::from(v as u32 as i32)
                };
                let digits = with_precision(v.unsigned_abs().to_string(), spec.precision);
                signed(&spec, v < 0, digits)
            }
            b'u' | b'x' | b'X' | b'o' => {
                let v = args.next(int_size)?;
                let v = if spec.long { v } else { v & 0xffff_ffff };
                let digits = match conv {
                    b'u' => v.to_string(),
                    b'x' => format!("{v:x}"),
                    b'X' => format!("{v:X}"),
                    _ => format!("{v:o}"),
                };
                let digits = with_precision(digits, spec.precision);
                let prefix = match (spec.alt && v != 0, conv) {
                    (true, b'x') => "0x",
                    (true, b'X') => "0X",
                    (true, b'o') => "0",
                    _ => "",
                };
                format!("{prefix}{digits}")
            }
            b'c' => char::from(args.next(4)? as u8).to_string(),
            b'p' => format!("0x{:x}", args.next(8)?),
            b's' => {
                let addr = args.next(8)?;
                let mut s = if addr == 0 {
                    b"(null)".to_vec()
                } else {
                    args.string(addr)?
                };
                if let Some(p) = spec.precision {
                    s.truncate(p);
                }
                s.into_iter().map(char::from).collect()
            }
            b'f' | b'F' | b'e' | b'E' | b'g' | b'G' | b'a' | b'A' => {
                let v = f64::from_bits(args.next(8)?);
                float(&spec, conv, v)
            }
            other => {
                out.push('%');
                out.push(char::from(other));
                continue;
            }
        };
        pad(
            &mut out,
            &spec,
            body,
            matches!(
                conv,
                b'd' | b'i' | b'u' | b'x' | b'X' | b'o' | b'f' | b'F' | b'e' | b'E' | b'g' | b'G'
            ),
        );
    }
    Ok(out)
}

fn with_precision(digits: String, precision: Option<usize>) -> String {
    match precision {
        Some(0) if digits == "0" => String::new(),
        Some(p) if digits.len() < p => format!("{}{digits}", "0".repeat(p - digits.len())),
        _ => digits,
    }
}

fn signed(spec: &Spec, negative: bool, digits: String) -> String {
    let sign = if negative {
        "-"
    } else if spec.plus {
        "+"
    } else if spec.space {
        " "
    } else {
        ""
    };
    format!("{sign}{digits}")
}

/// Pads to the field width; zero padding goes after the sign or prefix.
fn pad(out: &mut String, spec: &Spec, body: String, numeric: bool) {
    let len = body.chars().count();
    if len >= spec.width {
        out.push_str(&body);
    } else if spec.left {
        out.push_str(&body);
        out.push_str(&" ".repeat(spec.width - len));
    } else if spec.zero && numeric && (spec.precision.is_none() || body.contains(['.', 'e', 'E'])) {
        let split = body
            .find(|c: char| c.is_ascii_digit())
            .map(|i| {
                if body[i..].starts_with("0x") || body[i..].starts_with("0X") {
                    i + 2
                } else {
                    i
                }
            })
            .unwrap_or(0);
        let (head, tail) = body.split_at(split);
        out.push_str(head);
        out.push_str(&"0".repeat(spec.width - len));
        out.push_str(tail);
    } else {
        out.push_str(&" ".repeat(spec.width - len));
        out.push_str(&body);
    }
}

/// `%e` as C writes it: at least two exponent digits with a sign.
fn exp_form(v: f64, precision: usize, upper: bool) -> String {
    let s = format!("{:.*e}", precision, v.abs());
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let e = if upper { 'E' } else { 'e' };
    format!(
        "{mantissa}{e}{}{:02}",
        if exp < 0 { '-' } else { '+' },
        exp.abs()
    )
}

fn float(spec: &Spec, conv: u8, v: f64) -> String {
    let upper = conv.is_ascii_uppercase();
    let body = if v.is_nan() {
        "nan".to_string()
    } else if v.is_infinite() {
        "inf".to_string()
    } else {
        let p = spec.precision.unwrap_or(6);
        match conv.to_ascii_lowercase() {
            b'f' => format!("{:.*}", p, v.abs()),
            b'e' => exp_form(v, p, upper),
            b'a' => format!("{:e}", v.abs()),
            _ => {
                let p = if p == 0 { 1 } else { p };
                let x = if v == 0.0 {
                    0
                } else {
                    exp_form(v, p - 1, false)
                        .rsplit_once('e')
                        .map_or(0, |(_, e)| e.parse::<i32>().unwrap_or(0))
                };
                let mut s = if x < p as i32 && x >= -4 {
                    format!("{:.*}", (p as i32 - 1 - x).max(0) as usize, v.abs())
                } else {
                    exp_form(v, p - 1, upper)
                };
                if !spec.alt {
                    let (m, e) = match s.find(['e', 'E']) {
                        Some(i) => (s[..i].to_string(), s[i..].to_string()),
                        None => (s.clone(), String::new()),
                    };
                    let m = if m.contains('.') {
                        m.trim_end_matches('0').trim_end_matches('.').to_string()
                    } else {
                        m
                    };
                    s = m + &e;
                }
                s
            }
        }
    };
    let body = if upper { body.to_uppercase() } else { body };
    signed(spec, v.is_sign_negative() && !v.is_nan(), body)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Buf(Vec<u64>, Vec<(u64, &'static str)>);

    impl Args for Buf {
        fn next(&mut self, _size: u64) -> ComputeResult<u64> {
            Ok(if self.0.is_empty() {
                0
            } else {
                self.0.remove(0)
            })
        }
        fn string(&mut self, addr: u64) -> ComputeResult<Vec<u8>> {
            Ok(self
                .1
                .iter()
                .find(|(a, _)| *a == addr)
                .map_or(b"?".to_vec(), |(_, s)| s.as_bytes().to_vec()))
        }
    }

    fn f(fmt: &str, args: Vec<u64>) -> String {
        format(fmt.as_bytes(), &mut Buf(args, vec![(0x100, "hello")])).unwrap()
    }

    #[test]
    fn c_conversions() {
        assert_eq!(
            f("%d %i %u", vec![(-5i32) as u32 as u64, 7, 0xffff_ffff]),
            "-5 7 4294967295"
        );
        assert_eq!(
            f("%5d|%-5d|%05d", vec![42, 42, (-42i32) as u32 as u64]),
            "   42|42   |-0042"
        );
        assert_eq!(f("%x %X %#x %o", vec![255, 255, 255, 8]), "ff FF 0xff 10");
        assert_eq!(
            f("%lld %llu", vec![(-1i64) as u64, u64::MAX]),
            "-1 18446744073709551615"
        );
        assert_eq!(
            f(
                "%f %.2f %e",
                vec![1.5f64.to_bits(), 2.5151f64.to_bits(), 1234.5f64.to_bits()]
            ),
            "1.500000 2.52 1.234500e+03"
        );
        assert_eq!(
            f(
                "%g %g %g",
                vec![
                    0.0001f64.to_bits(),
                    100000.0f64.to_bits(),
                    1e-5f64.to_bits()
                ]
            ),
            "0.0001 100000 1e-05"
        );
        assert_eq!(
            f("%s|%.3s|%c|%%|%p", vec![0x100, 0x100, 65, 0xdead]),
            "hello|hel|A|%|0xdead"
        );
        assert_eq!(
            f(
                "%f %f",
                vec![f64::NAN.to_bits(), f64::NEG_INFINITY.to_bits()]
            ),
            "nan -inf"
        );
    }
}
