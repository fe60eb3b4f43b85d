//! Man pages from a binary's clap definition: clap_mangen's sections (name, synopsis,
//! description, options, subcommands, version), then the sections the binary writes in its long
//! after-help text, which `--help` prints after the options: a line of capitals alone
//! (`EXAMPLES`, `FILES`, `SEE ALSO`, `EXIT STATUS`) heads a section, paragraphs are separated by
//! blank lines, and lines indented by two spaces are kept as they are (commands, paths). Text
//! before the first heading goes under `NOTES`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use clap::Command;
use clap_mangen::Man;
use roff::{Roff, roman};

/// Longest heading of an after-help section (`SEE ALSO`, `EXIT STATUS`).
const MAX_HEADING: usize = 24;

/// `cmd`'s page (roff).
pub fn page(cmd: &Command) -> io::Result<Vec<u8>> {
    let man = Man::new(cmd.clone());
    let mut out = Vec::new();
    man.render_title(&mut out)?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut out)?;
    }
    if cmd.has_subcommands() {
        man.render_subcommands_section(&mut out)?;
    }
    let after = cmd.get_after_long_help().or_else(|| cmd.get_after_help());
    if let Some(text) = after {
        render_sections(&sections(&text.to_string()), &mut out)?;
    }
    if cmd.get_version().is_some() {
        man.render_version_section(&mut out)?;
    }
    Ok(out)
}

/// Writes `cmd`'s page and one per visible subcommand (`NAME-SUB.1`, the pages the
/// SUBCOMMANDS section names) into `dir`; returns their paths.
pub fn write_pages(cmd: &Command, dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut cmd = cmd.clone().disable_help_subcommand(true);
    cmd.build();
    let mut written = Vec::new();
    let mut write = |c: &Command| -> io::Result<()> {
        let path = dir.join(format!(
            "{}.1",
            c.get_display_name().unwrap_or(c.get_name())
        ));
        let mut file = std::fs::File::create(&path)?;
        file.write_all(&page(c)?)?;
        written.push(path);
        Ok(())
    };
    write(&cmd)?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        write(sub)?;
    }
    Ok(written)
}

/// The after-help text's sections: (heading, body).
pub fn sections(text: &str) -> Vec<(String, String)> {
    let heading = |line: &str| {
        let l = line.trim_end();
        (!l.is_empty()
            && l.len() <= MAX_HEADING
            && !l.starts_with(' ')
            && l.chars().all(|c| c.is_ascii_uppercase() || c == ' ')
            && l.chars().any(|c| c.is_ascii_uppercase()))
        .then(|| l.to_owned())
    };
    let mut out: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        match heading(line) {
            Some(h) => out.push((h, String::new())),
            None => {
                if out.is_empty() {
                    if line.trim().is_empty() {
                        continue;
                    }
                    out.push(("NOTES".to_owned(), String::new()));
                }
                let body = &mut out.last_mut().expect("a section").1;
                body.push_str(line);
                body.push('\n');
            }
        }
    }
    out.retain(|(_, body)| !body.trim().is_empty());
    out
}

fn render_sections(sections: &[(String, String)], w: &mut dyn Write) -> io::Result<()> {
    let mut roff = Roff::new();
    for (heading, body) in sections {
        roff.control("SH", [heading.as_str()]);
        for para in body.split("\n\n").filter(|p| !p.trim().is_empty()) {
            let lines: Vec<&str> = para.lines().filter(|l| !l.trim().is_empty()).collect();
            if lines.iter().all(|l| l.starts_with("  ")) {
                roff.control("PP", []).control("nf", []);
                for line in lines {
                    roff.control("RS", ["4"])
                        .text([roman(line.trim())])
                        .control("RE", []);
                }
                roff.control("fi", []);
            } else {
                let joined: Vec<&str> = lines.iter().map(|l| l.trim()).collect();
                roff.control("PP", []).text([roman(joined.join(" "))]);
            }
        }
    }
    roff.to_writer(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn after_help_becomes_sections() {
        let text = "Exit codes: 0 ok; 1 refused.\n\nEXAMPLES\n  vgpuctl list\n  vgpuctl show vm1\n\nThe first of\ntwo lines.\n\nFILES\n  /etc/vgpu/vgpus/NAME.json\n\nSEE ALSO\nvgpu-schedd(8)\n";
        let s = sections(text);
        let heads: Vec<&str> = s.iter().map(|(h, _)| h.as_str()).collect();
        assert_eq!(heads, ["NOTES", "EXAMPLES", "FILES", "SEE ALSO"]);
        let mut out = Vec::new();
        render_sections(&s, &mut out).unwrap();
        let roff = String::from_utf8(out).unwrap();
        assert!(
            roff.contains(".SH EXAMPLES\n.PP\n.nf\n.RS 4\nvgpuctl list\n.RE\n"),
            "{roff}"
        );
        assert!(roff.contains(".PP\nThe first of two lines.\n"), "{roff}");
        assert!(
            roff.contains(".SH \"SEE ALSO\"\n.PP\nvgpu\\-schedd(8)\n"),
            "{roff}"
        );
        // Only capitals alone on a line head a section.
        assert_eq!(sections("Use NOW\n  NOW\nA b\n").len(), 1);
        assert!(sections("\n\n").is_empty());
    }
}
