//! TimeGraph specification lines (§3, "Specification"): `<name:sched:resv:prio:C:T>`.
//!
//! `name` is the vGPU's name, `sched` is `prt` or `ht`, `resv` is `pe`, `ae`, `none` or the
//! name of a Shared reserve, `prio` is a number or `*` (automatic priority assignment: the
//! focused vGPU gets the highest priority), and the vGPU may use the GPU for `C` microseconds
//! every `T` microseconds. Keywords are case-insensitive.

use crate::model::{NS_PER_US, Nanos, PrioPolicy};

/// Longest spec line accepted, in bytes: a line is a handful of short fields, and the bound
/// keeps the values echoed in error messages short.
pub const MAX_SPEC_LEN: usize = 512;
/// Longest vGPU or Shared reserve name accepted in a spec line, in bytes.
pub const MAX_NAME_LEN: usize = 128;

/// The reservation a spec line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpecReserve {
    /// No reservation: the vGPU joins the Background reserve.
    None,
    /// A private Posterior Enforcement reserve of `C` every `T`.
    Pe,
    /// A private Apriori Enforcement reserve of `C` every `T`.
    Ae,
    /// Join the named Shared reserve. Its `C`, `T` and enforcement come from the policy's
    /// `shared` configuration; when that does not name it, the first member creates it with
    /// the line's `C` and `T` under Posterior Enforcement.
    Shared(String),
}

/// The priority a spec line asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecPriority {
    /// A fixed priority; higher is more urgent.
    Static(u32),
    /// `*`: the default wildcard priority, raised to the highest while the vGPU has focus.
    Wildcard,
}

/// One parsed spec line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// The vGPU name it applies to.
    pub name: String,
    /// Its priority policy.
    pub sched: PrioPolicy,
    /// Its reservation.
    pub reserve: SpecReserve,
    /// Its priority.
    pub priority: SpecPriority,
    /// Budget per period, in nanoseconds (the line gives microseconds).
    pub c: Nanos,
    /// Replenishment period, in nanoseconds (the line gives microseconds).
    pub t: Nanos,
}

/// Why a spec line was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The line is longer than [`MAX_SPEC_LEN`].
    #[error("spec line longer than {MAX_SPEC_LEN} bytes")]
    TooLong,
    /// The line is not enclosed in `<` and `>`.
    #[error("spec line must be enclosed in '<' and '>'")]
    Brackets,
    /// The line does not have exactly six fields.
    #[error("expected 6 fields <name:sched:resv:prio:C:T>, found {0}")]
    FieldCount(usize),
    /// The name is empty, too long or contains control characters or `<`/`>`.
    #[error("name {0:?} is empty, longer than {MAX_NAME_LEN} bytes or has forbidden characters")]
    BadName(String),
    /// The scheduling policy is neither `prt` nor `ht`.
    #[error("unknown scheduling policy {0:?} (expected prt or ht)")]
    UnknownSched(String),
    /// The reservation is neither a keyword nor a valid Shared reserve name.
    #[error("unknown reservation {0:?} (expected pe, ae, none or a shared reserve name)")]
    UnknownReserve(String),
    /// The priority is neither a number that fits in 32 bits nor `*`.
    #[error("priority {0:?} is neither a 32-bit number nor '*'")]
    BadPriority(String),
    /// `C` or `T` is not a decimal number.
    #[error("{field} {value:?} is not a whole number of microseconds")]
    NotANumber {
        /// `C` or `T`.
        field: &'static str,
        /// The text given.
        value: String,
    },
    /// `C` or `T` does not fit in 64 bits once converted to nanoseconds.
    #[error("{field} of {value} microseconds overflows 64-bit nanoseconds")]
    Overflow {
        /// `C` or `T`.
        field: &'static str,
        /// The text given.
        value: String,
    },
    /// A reservation with `T` = 0.
    #[error("period T must be greater than zero")]
    ZeroPeriod,
    /// A reservation with `C` = 0.
    #[error("capacity C must be greater than zero")]
    ZeroCapacity,
    /// A reservation with `C` > `T`.
    #[error("capacity C ({c} us) exceeds period T ({t} us)")]
    CapacityExceedsPeriod {
        /// `C` in microseconds.
        c: u64,
        /// `T` in microseconds.
        t: u64,
    },
}

/// True for a character that may appear in a Shared reserve name.
fn reserve_name_char(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || matches!(ch, '_' | '-' | '.')
}

/// Parses a microsecond field into nanoseconds; returns the microseconds too.
fn micros(field: &'static str, text: &str) -> Result<(u64, Nanos), SpecError> {
    let not_a_number = || SpecError::NotANumber {
        field,
        value: text.to_owned(),
    };
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(not_a_number());
    }
    let overflow = || SpecError::Overflow {
        field,
        value: text.to_owned(),
    };
    // All digits: the only way parsing fails is a value beyond u64.
    let us: u64 = text.parse().map_err(|_| overflow())?;
    let ns = us.checked_mul(NS_PER_US).ok_or_else(overflow)?;
    Ok((us, ns))
}

/// Parses one spec line `<name:sched:resv:prio:C:T>` (surrounding whitespace is ignored).
pub fn parse_spec(line: &str) -> Result<Spec, SpecError> {
    if line.len() > MAX_SPEC_LEN {
        return Err(SpecError::TooLong);
    }
    let body = line
        .trim()
        .strip_prefix('<')
        .and_then(|l| l.strip_suffix('>'))
        .ok_or(SpecError::Brackets)?;
    let fields: Vec<&str> = body.split(':').map(str::trim).collect();
    let [name, sched, resv, prio, c, t] = fields[..] else {
        return Err(SpecError::FieldCount(fields.len()));
    };
    if name.is_empty()
        || name.len() > MAX_NAME_LEN
        || name
            .chars()
            .any(|ch| ch.is_control() || ch == '<' || ch == '>')
    {
        return Err(SpecError::BadName(name.to_owned()));
    }
    let sched = match sched.to_ascii_lowercase().as_str() {
        "prt" => PrioPolicy::Prt,
        "ht" => PrioPolicy::Ht,
        _ => return Err(SpecError::UnknownSched(sched.to_owned())),
    };
    let reserve = match resv.to_ascii_lowercase().as_str() {
        "none" => SpecReserve::None,
        "pe" => SpecReserve::Pe,
        "ae" => SpecReserve::Ae,
        _ if !resv.is_empty()
            && resv.len() <= MAX_NAME_LEN
            && resv.chars().all(reserve_name_char) =>
        {
            SpecReserve::Shared(resv.to_owned())
        }
        _ => return Err(SpecError::UnknownReserve(resv.to_owned())),
    };
    let priority = if prio == "*" {
        SpecPriority::Wildcard
    } else if !prio.is_empty() && prio.bytes().all(|b| b.is_ascii_digit()) {
        let p = prio
            .parse()
            .map_err(|_| SpecError::BadPriority(prio.to_owned()))?;
        SpecPriority::Static(p)
    } else {
        return Err(SpecError::BadPriority(prio.to_owned()));
    };
    let (c_us, c) = micros("C", c)?;
    let (t_us, t) = micros("T", t)?;
    if reserve != SpecReserve::None {
        if t == 0 {
            return Err(SpecError::ZeroPeriod);
        }
        if c == 0 {
            return Err(SpecError::ZeroCapacity);
        }
        if c > t {
            return Err(SpecError::CapacityExceedsPeriod { c: c_us, t: t_us });
        }
    }
    Ok(Spec {
        name: name.to_owned(),
        sched,
        reserve,
        priority,
        c,
        t,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_papers_form() {
        let s = parse_spec(" <game:prt:pe:10:5000:16666> ").unwrap();
        assert_eq!(
            s,
            Spec {
                name: "game".into(),
                sched: PrioPolicy::Prt,
                reserve: SpecReserve::Pe,
                priority: SpecPriority::Static(10),
                c: 5_000_000,
                t: 16_666_000,
            }
        );
        let s = parse_spec("<bomb:HT:bombs:*:2500:25000>").unwrap();
        assert_eq!(s.sched, PrioPolicy::Ht);
        assert_eq!(s.reserve, SpecReserve::Shared("bombs".into()));
        assert_eq!(s.priority, SpecPriority::Wildcard);
        // Without a reservation C and T are not checked against each other.
        let s = parse_spec("<x:prt:none:0:0:0>").unwrap();
        assert_eq!((s.reserve, s.c, s.t), (SpecReserve::None, 0, 0));
        assert_eq!(
            parse_spec("<v:ht:AE:1:1:1>").unwrap().reserve,
            SpecReserve::Ae
        );
    }

    #[test]
    fn refuses_malformed_lines_precisely() {
        use SpecError as E;
        let cases: Vec<(String, SpecError)> = vec![
            ("game:prt:pe:10:5000:16666".into(), E::Brackets),
            ("<game:prt:pe:10:5000:16666".into(), E::Brackets),
            ("<game:prt:pe:10:5000>".into(), E::FieldCount(5)),
            ("<game:prt:pe:10:5000:1:2>".into(), E::FieldCount(7)),
            ("<>".into(), E::FieldCount(1)),
            ("<:prt:pe:10:5:16>".into(), E::BadName(String::new())),
            ("<g:rr:pe:10:5:16>".into(), E::UnknownSched("rr".into())),
            ("<g:prt::10:5:16>".into(), E::UnknownReserve(String::new())),
            (
                "<g:prt:a/b:10:5:16>".into(),
                E::UnknownReserve("a/b".into()),
            ),
            ("<g:prt:pe:high:5:16>".into(), E::BadPriority("high".into())),
            ("<g:prt:pe:-1:5:16>".into(), E::BadPriority("-1".into())),
            (
                "<g:prt:pe:4294967296:5:16>".into(),
                E::BadPriority("4294967296".into()),
            ),
            (
                "<g:prt:pe:1:five:16>".into(),
                E::NotANumber {
                    field: "C",
                    value: "five".into(),
                },
            ),
            (
                "<g:prt:pe:1:5:-16>".into(),
                E::NotANumber {
                    field: "T",
                    value: "-16".into(),
                },
            ),
            (
                "<g:prt:pe:1:5:1.5>".into(),
                E::NotANumber {
                    field: "T",
                    value: "1.5".into(),
                },
            ),
            (
                "<g:prt:pe:1:5:18446744073709552>".into(),
                E::Overflow {
                    field: "T",
                    value: "18446744073709552".into(),
                },
            ),
            (
                "<g:prt:pe:1:5:99999999999999999999999>".into(),
                E::Overflow {
                    field: "T",
                    value: "99999999999999999999999".into(),
                },
            ),
            ("<g:prt:pe:1:5:0>".into(), E::ZeroPeriod),
            ("<g:prt:ae:1:0:10>".into(), E::ZeroCapacity),
            (
                "<g:prt:pe:1:20:10>".into(),
                E::CapacityExceedsPeriod { c: 20, t: 10 },
            ),
            (
                "<g:prt:shared:1:20:10>".into(),
                E::CapacityExceedsPeriod { c: 20, t: 10 },
            ),
            (
                format!("<{}:prt:pe:1:5:10>", "n".repeat(MAX_SPEC_LEN)),
                E::TooLong,
            ),
            (
                format!("<{}:prt:pe:1:5:10>", "n".repeat(MAX_NAME_LEN + 1)),
                E::BadName("n".repeat(MAX_NAME_LEN + 1)),
            ),
        ];
        for (line, want) in cases {
            assert_eq!(parse_spec(&line), Err(want), "{line}");
        }
        // The largest T that still fits in nanoseconds is accepted.
        let max_us = u64::MAX / NS_PER_US;
        assert!(parse_spec(&format!("<g:prt:pe:1:5:{max_us}>")).is_ok());
    }
}
