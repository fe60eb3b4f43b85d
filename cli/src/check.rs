//! The check each binary's unit tests run on its own command line: the conventions of this
//! crate hold for it (`--version` names the version, `--help` works, the completion script
//! offers every visible long option, the man page names the program), and clap finds no
//! mistake in the definition (`Command::debug_assert`, which panics on one).

use std::ffi::OsString;

use clap::Parser;
use clap::error::ErrorKind;

use crate::{Parsed, command, try_parse_from};

/// Checks `P`'s command line; `version` is the binary's `CARGO_PKG_VERSION`.
pub fn conventions<P: Parser + std::fmt::Debug>(version: &str) -> Result<(), String> {
    let cmd = command::<P>();
    cmd.clone().debug_assert();
    let name = cmd.get_name().to_owned();
    let run = |arg: &str| try_parse_from::<P, _, _>([name.as_str(), arg]);
    match run("--version") {
        Err(e) if e.kind() == ErrorKind::DisplayVersion && e.to_string().contains(version) => {}
        other => return Err(format!("--version: {other:?}")),
    }
    match run("--help") {
        Err(e) if e.kind() == ErrorKind::DisplayHelp && e.to_string().contains("Usage") => {}
        other => return Err(format!("--help: {other:?}")),
    }
    let generated = |arg: &[&str]| match try_parse_from::<P, _, _>(
        std::iter::once(name.as_str()).chain(arg.iter().copied()),
    ) {
        Ok(Parsed::Generated(out)) => String::from_utf8(out).map_err(|e| e.to_string()),
        other => Err(format!("{arg:?}: {other:?}")),
    };
    let bash = generated(&["--completions", "bash"])?;
    let longs = std::iter::once(&cmd)
        .chain(cmd.get_subcommands())
        .flat_map(|c| c.get_arguments())
        .filter(|a| !a.is_hide_set())
        .filter_map(|a| a.get_long());
    for long in longs {
        if !bash.contains(&format!("--{long}")) {
            return Err(format!("the bash completions miss --{long}"));
        }
    }
    let man = generated(&["--man"])?;
    if !man.contains(".TH") || !man.contains(&name.replace('-', "\\-")) {
        return Err(format!("the man page does not name {name}:\n{man}"));
    }
    // --man-dir writes the page and every subcommand's page the page names.
    let dir = std::env::temp_dir().join(format!("vgpu-cli-man-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let listed = generated(&["--man-dir", &dir.to_string_lossy()]);
    let written: Vec<String> = std::fs::read_dir(&dir)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    let listed = listed?;
    let mut wanted = vec![format!("{name}.1")];
    wanted.extend(
        cmd.get_subcommands()
            .filter(|s| !s.is_hide_set())
            .map(|s| format!("{name}-{}.1", s.get_name())),
    );
    for page in &wanted {
        if !written.contains(page) || !listed.contains(page.as_str()) {
            return Err(format!("--man-dir did not write {page}: {written:?}"));
        }
    }
    Ok(())
}

/// Checks `P`'s table of values its completions ask it for ([`crate::complete`]): each entry
/// names a subcommand of `P` and one of its arguments that takes a value (not after `--`),
/// and the bash, zsh and fish completion scripts ask the binary.
pub fn completion_values<P: Parser + std::fmt::Debug>(
    values: &[crate::Values],
) -> Result<(), String> {
    let mut cmd = command::<P>();
    cmd.build();
    let name = cmd.get_name().to_owned();
    for v in values {
        let sub = cmd
            .find_subcommand(v.subcommand)
            .ok_or_else(|| format!("{name} has no subcommand {}", v.subcommand))?;
        let arg = sub.get_arguments().find(|a| a.get_id() == v.arg);
        // Values after `--` are never completed: they are another program's arguments.
        if !arg.is_some_and(|a| a.get_action().takes_values() && !a.is_last_set()) {
            return Err(format!(
                "{name} {} has no argument {} with a value before --",
                v.subcommand, v.arg
            ));
        }
        if v.queries.is_empty() {
            return Err(format!("{name} {} {}: no query", v.subcommand, v.arg));
        }
    }
    for shell in ["bash", "zsh", "fish"] {
        let script = match crate::try_parse_from_with::<P, _, _>(
            [name.as_str(), "--completions", shell],
            values,
        ) {
            Ok(Parsed::Generated(out)) => String::from_utf8(out).map_err(|e| e.to_string())?,
            other => return Err(format!("--completions {shell}: {other:?}")),
        };
        let asks = format!("{name} {} WORD... CURRENT", crate::complete::COMPLETE);
        if !script.contains(&asks) {
            return Err(format!(
                "the {shell} completions of {name} do not ask it for values"
            ));
        }
    }
    Ok(())
}

/// Sections an installed tool's man page has beyond the generated ones (written in its long
/// after-help text, [`crate::man`]).
pub const OPERATOR_SECTIONS: [&str; 3] = ["EXAMPLES", "FILES", "SEE ALSO"];

/// Checks that `P`'s man page has every section of [`OPERATOR_SECTIONS`], each with text.
pub fn operator_man_page<P: Parser + std::fmt::Debug>() -> Result<(), String> {
    let cmd = command::<P>();
    let name = cmd.get_name().to_owned();
    let man = match try_parse_from::<P, _, _>([name.as_str(), "--man"]) {
        Ok(Parsed::Generated(out)) => String::from_utf8(out).map_err(|e| e.to_string())?,
        other => return Err(format!("--man: {other:?}")),
    };
    for section in OPERATOR_SECTIONS {
        let head = if section.contains(' ') {
            format!(".SH \"{section}\"\n.PP")
        } else {
            format!(".SH {section}\n.PP")
        };
        if !man.contains(&head) {
            return Err(format!("{name}'s man page has no {section} section"));
        }
    }
    Ok(())
}

/// Parses `line`, the arguments after the program's name, as the binary does (for its tests):
/// `Err` for a usage error, and for `--completions` or `--man`, which print instead of running.
pub fn arguments<P, I, T>(line: I) -> Result<P, clap::Error>
where
    P: Parser,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let name = OsString::from(command::<P>().get_name());
    let line = std::iter::once(name).chain(line.into_iter().map(Into::into));
    match try_parse_from::<P, _, _>(line)? {
        Parsed::Run(p) => Ok(p),
        Parsed::Generated(_) => Err(clap::Error::raw(
            ErrorKind::ArgumentConflict,
            "--completions and --man print; they run nothing",
        )),
    }
}
