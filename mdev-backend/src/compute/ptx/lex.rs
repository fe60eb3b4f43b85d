//! PTX tokens. The lexer never fails on its input: bytes it does not know become
//! [`Tok::Punct`] and the parser refuses them with a line number. It stops only when its
//! load is cancelled.

use std::fmt;

use super::parse::{Meter, Stop};

/// Input bytes lexed between two looks at the cancel flag where no token is made (comments,
/// white space): about a millisecond of work.
const CANCEL_CHECK_BYTES: usize = 1 << 20;

/// One token and the line it starts on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Token<'a> {
    pub tok: Tok<'a>,
    pub line: u32,
}

/// A name's or string's characters an error message shows: a guest's token can be as long as
/// its text, and a message must not be.
const SHOWN_CHARS: usize = 48;

/// Names and strings are slices of the text: a token holds no memory of its own.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Tok<'a> {
    /// A name: opcode with its modifiers (`ld.global.f32`), register (`%r1`, `%tid.x`), label
    /// (`$L__BB0_2`), symbol.
    Word(&'a str),
    /// A directive or a lone modifier: `.reg`, `.f32`.
    Directive(&'a str),
    /// An integer literal (decimal, hex, octal or binary); the sign is a separate token.
    Int(u64),
    /// `0fXXXXXXXX`: the bits of an f32.
    F32(u32),
    /// `0dXXXXXXXXXXXXXXXX`: the bits of an f64.
    F64(u64),
    /// A decimal floating-point literal.
    Float(f64),
    Str(&'a str),
    Punct(char),
    /// The end of a line (only `.loc`/`.file`/`.version`-style directives care).
    Newline,
    /// A register the parser resolved already (an element of a vector register standing
    /// for its braced list); never made by the lexer.
    Reg(u32),
}

fn is_word_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%')
}

fn is_word_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.')
}

/// A name or string as an error message shows it: at most [`SHOWN_CHARS`] characters.
struct Shown<'a>(&'a str);

impl fmt::Debug for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(SHOWN_CHARS) {
            None => write!(f, "{:?}", self.0),
            Some((cut, _)) => write!(f, "{:?}... ({} bytes)", &self.0[..cut], self.0.len()),
        }
    }
}

impl fmt::Debug for Tok<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Word(s) => f.debug_tuple("Word").field(&Shown(s)).finish(),
            Tok::Directive(s) => f.debug_tuple("Directive").field(&Shown(s)).finish(),
            Tok::Str(s) => f.debug_tuple("Str").field(&Shown(s)).finish(),
            Tok::Int(v) => f.debug_tuple("Int").field(v).finish(),
            Tok::F32(v) => f.debug_tuple("F32").field(v).finish(),
            Tok::F64(v) => f.debug_tuple("F64").field(v).finish(),
            Tok::Float(v) => f.debug_tuple("Float").field(v).finish(),
            Tok::Punct(c) => f.debug_tuple("Punct").field(c).finish(),
            Tok::Newline => f.write_str("Newline"),
            Tok::Reg(r) => f.debug_tuple("Reg").field(r).finish(),
        }
    }
}

/// Splits a text into tokens, one at a time as the parser asks: tokens are never all held.
/// Comments (`//`, `/* */`) are dropped. Works on bytes: every boundary it cuts at is an
/// ASCII byte, so each cut is a character boundary; a character outside ASCII is white space
/// or punctuation.
#[derive(Debug)]
pub(crate) struct Lexer<'a> {
    text: &'a str,
    at: usize,
    line: u32,
    /// Where the cancel flag is looked at next.
    next_check: usize,
}

impl<'a> Lexer<'a> {
    pub(crate) fn new(text: &'a str) -> Lexer<'a> {
        Lexer {
            text,
            at: 0,
            line: 1,
            next_check: 0,
        }
    }

    /// The line the lexer is on.
    pub(crate) fn line(&self) -> u32 {
        self.line
    }

    /// Fails when the load was cancelled, looking every [`CANCEL_CHECK_BYTES`] of input.
    fn check(&mut self, meter: &Meter<'_>) -> Result<(), Stop> {
        if self.at >= self.next_check {
            meter.check()?;
            self.next_check = self.at.saturating_add(CANCEL_CHECK_BYTES);
        }
        Ok(())
    }

    /// The next token, `None` at the end of the text; stops when `meter`'s load is
    /// cancelled.
    pub(crate) fn next(&mut self, meter: &Meter<'_>) -> Result<Option<Token<'a>>, Stop> {
        let (text, b) = (self.text, self.text.as_bytes());
        while self.at < b.len() {
            self.check(meter)?;
            let (i, line) = (self.at, self.line);
            let token = |tok| Ok(Some(Token { tok, line }));
            let c = b[i];
            if c == b'\n' {
                self.line = line.saturating_add(1);
                self.at += 1;
                return token(Tok::Newline);
            } else if c.is_ascii_whitespace() {
                self.at += 1;
            } else if c == b'/' && b.get(i + 1) == Some(&b'/') {
                self.at = b[i..]
                    .iter()
                    .position(|&c| c == b'\n')
                    .map_or(b.len(), |n| i + n);
            } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
                self.at += 2;
                while self.at < b.len()
                    && !(b[self.at] == b'*' && b.get(self.at + 1) == Some(&b'/'))
                {
                    if b[self.at] == b'\n' {
                        self.line = self.line.saturating_add(1);
                    }
                    self.at += 1;
                    self.check(meter)?;
                }
                self.at += 2;
            } else if c == b'"' {
                let end = b[i + 1..]
                    .iter()
                    .position(|&c| c == b'"' || c == b'\n')
                    .map_or(b.len(), |n| i + 1 + n);
                self.at = end + 1;
                return token(Tok::Str(&text[i + 1..end]));
            } else if c == b'.' && b.get(i + 1).is_some_and(|&n| is_word_start(n)) {
                let end = self.scan(i + 1, |c| is_word_char(c) && c != b'.');
                return token(Tok::Directive(&text[i..end]));
            } else if is_word_start(c) {
                let end = self.scan(i + 1, is_word_char);
                return token(Tok::Word(&text[i..end]));
            } else if c.is_ascii_digit() {
                let mut end = i;
                while end < b.len() && (b[end].is_ascii_alphanumeric() || b[end] == b'.') {
                    // An exponent's sign belongs to the number.
                    if matches!(b[end], b'e' | b'E')
                        && matches!(b.get(end + 1), Some(b'+' | b'-'))
                        && !b[i..end]
                            .iter()
                            .any(|c| matches!(c, b'x' | b'X' | b'f' | b'd'))
                    {
                        end += 1;
                    }
                    end += 1;
                }
                self.at = end;
                return token(number(&text[i..end]));
            } else {
                let ch = text[i..].chars().next().unwrap_or('\u{fffd}');
                self.at += ch.len_utf8();
                if !ch.is_whitespace() {
                    return token(Tok::Punct(ch));
                }
            }
        }
        Ok(None)
    }

    /// Moves past the bytes from `from` that `more` accepts; where it stopped.
    fn scan(&mut self, from: usize, more: impl Fn(u8) -> bool) -> usize {
        let b = self.text.as_bytes();
        let end = b[from..]
            .iter()
            .position(|&c| !more(c))
            .map_or(b.len(), |n| from + n);
        self.at = end;
        end
    }
}

/// A numeric literal, or `Punct('#')` (refused by the parser) when it is malformed.
fn number(text: &str) -> Tok<'static> {
    let lower = text.to_ascii_lowercase();
    let body = lower.strip_suffix('u').unwrap_or(&lower);
    let parsed = if let Some(hex) = body.strip_prefix("0x") {
        u64::from_str_radix(hex, 16).ok().map(Tok::Int)
    } else if let Some(bits) = body.strip_prefix("0f") {
        (bits.len() == 8)
            .then(|| u32::from_str_radix(bits, 16).ok().map(Tok::F32))
            .flatten()
    } else if let Some(bits) = body.strip_prefix("0d") {
        (bits.len() == 16)
            .then(|| u64::from_str_radix(bits, 16).ok().map(Tok::F64))
            .flatten()
    } else if let Some(bin) = body.strip_prefix("0b") {
        u64::from_str_radix(bin, 2).ok().map(Tok::Int)
    } else if body.contains(['.', 'e']) {
        body.parse::<f64>().ok().map(Tok::Float)
    } else if body.len() > 1 && body.starts_with('0') {
        u64::from_str_radix(&body[1..], 8).ok().map(Tok::Int)
    } else {
        body.parse::<u64>().ok().map(Tok::Int)
    };
    parsed.unwrap_or(Tok::Punct('#'))
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;

    use super::*;
    use crate::budget::MemoryBudget;

    #[test]
    fn opcodes_registers_literals_and_comments() {
        let (budget, cancel) = (MemoryBudget::new(1 << 20), AtomicBool::new(false));
        let meter = Meter::new(&budget, &cancel);
        let mut lexer = Lexer::new(
            "ld.global.f32 %f1, [%rd2+-4]; // x\n/* y */ 0f3F800000 1.5e-3 0x10 017 .reg",
        );
        let toks: Vec<Tok> = std::iter::from_fn(|| lexer.next(&meter).unwrap())
            .map(|t| t.tok)
            .filter(|t| *t != Tok::Newline)
            .collect();
        assert_eq!(
            toks,
            [
                Tok::Word("ld.global.f32"),
                Tok::Word("%f1"),
                Tok::Punct(','),
                Tok::Punct('['),
                Tok::Word("%rd2"),
                Tok::Punct('+'),
                Tok::Punct('-'),
                Tok::Int(4),
                Tok::Punct(']'),
                Tok::Punct(';'),
                Tok::F32(0x3f80_0000),
                Tok::Float(1.5e-3),
                Tok::Int(16),
                Tok::Int(15),
                Tok::Directive(".reg"),
            ]
        );
    }
}
