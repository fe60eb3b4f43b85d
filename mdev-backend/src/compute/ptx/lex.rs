//! PTX tokens. The lexer never fails: bytes it does not know become [`Tok::Punct`] and the
//! parser refuses them with a line number.

/// One token and the line it starts on.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Token {
    pub tok: Tok,
    pub line: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Tok {
    /// A name: opcode with its modifiers (`ld.global.f32`), register (`%r1`, `%tid.x`), label
    /// (`$L__BB0_2`), symbol.
    Word(String),
    /// A directive or a lone modifier: `.reg`, `.f32`.
    Directive(String),
    /// An integer literal (decimal, hex, octal or binary); the sign is a separate token.
    Int(u64),
    /// `0fXXXXXXXX`: the bits of an f32.
    F32(u32),
    /// `0dXXXXXXXXXXXXXXXX`: the bits of an f64.
    F64(u64),
    /// A decimal floating-point literal.
    Float(f64),
    Str(String),
    Punct(char),
    /// The end of a line (only `.loc`/`.file`/`.version`-style directives care).
    Newline,
}

fn is_word_start(c: char) -> bool {
    c.is_ascii_alphabetic() || matches!(c, '_' | '$' | '%')
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '$' | '.')
}

/// Splits `text` into tokens. Comments (`//`, `/* */`) are dropped.
pub(crate) fn tokens(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut line = 1u32;
    let mut i = 0;
    let push = |out: &mut Vec<Token>, tok, line| out.push(Token { tok, line });
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            push(&mut out, Tok::Newline, line);
            line = line.saturating_add(1);
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && chars.get(i + 1) == Some(&'*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                if chars[i] == '\n' {
                    line = line.saturating_add(1);
                }
                i += 1;
            }
            i += 2;
        } else if c == '"' {
            let start = i + 1;
            i += 1;
            while i < chars.len() && chars[i] != '"' && chars[i] != '\n' {
                i += 1;
            }
            push(
                &mut out,
                Tok::Str(chars[start..i.min(chars.len())].iter().collect()),
                line,
            );
            i += 1;
        } else if c == '.' && chars.get(i + 1).is_some_and(|&n| is_word_start(n)) {
            let start = i;
            i += 1;
            while i < chars.len() && is_word_char(chars[i]) && chars[i] != '.' {
                i += 1;
            }
            push(
                &mut out,
                Tok::Directive(chars[start..i].iter().collect()),
                line,
            );
        } else if is_word_start(c) {
            let start = i;
            i += 1;
            while i < chars.len() && is_word_char(chars[i]) {
                i += 1;
            }
            push(&mut out, Tok::Word(chars[start..i].iter().collect()), line);
        } else if c.is_ascii_digit() {
            let start = i;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                // An exponent's sign belongs to the number.
                if matches!(chars[i], 'e' | 'E')
                    && matches!(chars.get(i + 1), Some('+' | '-'))
                    && !chars[start..i]
                        .iter()
                        .any(|c| matches!(c, 'x' | 'X' | 'f' | 'd'))
                {
                    i += 1;
                }
                i += 1;
            }
            let text: String = chars[start..i].iter().collect();
            push(&mut out, number(&text), line);
        } else {
            push(&mut out, Tok::Punct(c), line);
            i += 1;
        }
    }
    out
}

/// A numeric literal, or `Punct('#')` (refused by the parser) when it is malformed.
fn number(text: &str) -> Tok {
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
    use super::*;

    #[test]
    fn opcodes_registers_literals_and_comments() {
        let toks: Vec<Tok> =
            tokens("ld.global.f32 %f1, [%rd2+-4]; // x\n/* y */ 0f3F800000 1.5e-3 0x10 017 .reg")
                .into_iter()
                .map(|t| t.tok)
                .filter(|t| *t != Tok::Newline)
                .collect();
        assert_eq!(
            toks,
            [
                Tok::Word("ld.global.f32".into()),
                Tok::Word("%f1".into()),
                Tok::Punct(','),
                Tok::Punct('['),
                Tok::Word("%rd2".into()),
                Tok::Punct('+'),
                Tok::Punct('-'),
                Tok::Int(4),
                Tok::Punct(']'),
                Tok::Punct(';'),
                Tok::F32(0x3f80_0000),
                Tok::Float(1.5e-3),
                Tok::Int(16),
                Tok::Int(15),
                Tok::Directive(".reg".into()),
            ]
        );
    }
}
