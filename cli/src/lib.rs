//! The command-line conventions every vgpu binary shares.
//!
//! Each binary declares its arguments with clap's derive API (`#[command(version, about)]`
//! gives `--version` and `--help`) and parses them with [`parse`], which adds two exclusive
//! options to the command: `--completions SHELL` prints a completion script for that shell,
//! `--man` prints the binary's man page (roff) and `--man-dir DIR` writes it and one page per
//! subcommand into DIR ([`man`]), all generated from the same definition, so they never drift
//! from what the binary accepts. The install script and packagers call them. A binary whose
//! arguments take values only the running system knows (VM names) parses with [`parse_with`]
//! and a table of them: its bash, zsh and fish completions then ask it for those ([`complete`]).

#![forbid(unsafe_code)]

pub mod check;
pub mod complete;
pub mod man;
#[cfg(feature = "progress")]
pub mod progress;

use std::ffi::OsString;
use std::io::{self, Write};

use clap::{Arg, ArgAction, ArgMatches, Command, Parser, value_parser};
use clap_complete::Shell;
pub use complete::Values;

const COMPLETIONS: &str = "completions";
const MAN: &str = "man";
const MAN_DIR: &str = "man-dir";

/// What a binary's arguments asked for.
#[derive(Debug)]
pub enum Parsed<P> {
    /// Run with these arguments.
    Run(P),
    /// Print this completion script or man page and exit 0.
    Generated(Vec<u8>),
}

/// The binary's command with the generator options added.
pub fn command<P: Parser>() -> Command {
    P::command()
        .arg(
            Arg::new(COMPLETIONS)
                .long(COMPLETIONS)
                .value_name("SHELL")
                .value_parser(value_parser!(Shell))
                .exclusive(true)
                .help("Print a completion script for SHELL and exit"),
        )
        .arg(
            Arg::new(MAN)
                .long(MAN)
                .action(ArgAction::SetTrue)
                .exclusive(true)
                .help("Print the man page (roff) and exit"),
        )
        .arg(
            Arg::new(MAN_DIR)
                .long(MAN_DIR)
                .value_name("DIR")
                .value_parser(value_parser!(std::path::PathBuf))
                .exclusive(true)
                .help("Write the man page and one per subcommand into DIR, print their paths and exit"),
        )
        // An exclusive generator option stands alone, even where the command needs a
        // subcommand; without one, `P` itself says that the subcommand is missing.
        .subcommand_required(false)
}

/// Parses `args` (the first is the program name).
pub fn try_parse_from<P, I, T>(args: I) -> Result<Parsed<P>, clap::Error>
where
    P: Parser,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    try_parse_from_with(args, &[])
}

/// Parses `args` as [`try_parse_from`] does, for a binary whose completions ask it for the
/// values of the arguments in `values`.
pub fn try_parse_from_with<P, I, T>(args: I, values: &[Values]) -> Result<Parsed<P>, clap::Error>
where
    P: Parser,
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let mut cmd = command::<P>();
    let matches = cmd.try_get_matches_from_mut(args)?;
    if let Some(out) = generated(&mut cmd, &matches, values)? {
        return Ok(Parsed::Generated(out));
    }
    P::from_arg_matches(&matches)
        .map(Parsed::Run)
        .map_err(|e| e.format(&mut cmd))
}

fn generated(
    cmd: &mut Command,
    matches: &ArgMatches,
    values: &[Values],
) -> Result<Option<Vec<u8>>, clap::Error> {
    let asked =
        matches.contains_id(COMPLETIONS) || matches.get_flag(MAN) || matches.contains_id(MAN_DIR);
    if asked && matches.subcommand().is_some() {
        return Err(cmd.error(
            clap::error::ErrorKind::ArgumentConflict,
            "--completions and --man stand alone",
        ));
    }
    let mut out = Vec::new();
    let io = |e: io::Error| clap::Error::raw(clap::error::ErrorKind::Io, e);
    if let Some(&shell) = matches.get_one::<Shell>(COMPLETIONS) {
        let name = cmd.get_name().to_owned();
        clap_complete::generate(shell, cmd, name.as_str(), &mut out);
        if values.is_empty() {
            return Ok(Some(out));
        }
        let script = String::from_utf8(out).map_err(|e| io(io::Error::other(e)))?;
        let hooked =
            complete::hooked(shell, cmd, values, script).map_err(|e| io(io::Error::other(e)))?;
        return Ok(Some(hooked.into_bytes()));
    }
    if matches.get_flag(MAN) {
        return man::page(cmd).map(Some).map_err(io);
    }
    if let Some(dir) = matches.get_one::<std::path::PathBuf>(MAN_DIR) {
        for path in man::write_pages(cmd, dir).map_err(io)? {
            writeln!(out, "{}", path.display()).map_err(io)?;
        }
        return Ok(Some(out));
    }
    Ok(None)
}

/// The value parser of every binary's `--log-level`: `off`, `error`, `warn`, `info`, `debug`
/// or `trace` (any case), listed in the help and the completions.
pub fn log_level() -> impl clap::builder::TypedValueParser<Value = log::LevelFilter> {
    use clap::builder::{PossibleValuesParser, TypedValueParser};
    PossibleValuesParser::new(["off", "error", "warn", "info", "debug", "trace"])
        .try_map(|l| l.parse::<log::LevelFilter>().map_err(|e| e.to_string()))
}

/// Parses the process's arguments: prints help, version, usage errors, completions and man
/// pages and exits as clap does (0, or 2 for a usage error); otherwise returns the arguments.
pub fn parse<P: Parser>() -> P {
    parse_with(&[])
}

/// Parses the process's arguments as [`parse`] does, for a binary whose completions ask it for
/// the values of the arguments in `values`; answers such a question ([`complete::COMPLETE`]):
/// prints the values and exits 0, or exits 1 where the static completions apply.
pub fn parse_with<P: Parser>(values: &[Values]) -> P {
    let args: Vec<OsString> = std::env::args_os().collect();
    if !values.is_empty() && args.get(1).is_some_and(|a| a == complete::COMPLETE) {
        let words: Vec<String> = args
            .iter()
            .skip(2)
            .map(|w| w.to_string_lossy().into_owned())
            .collect();
        let exe = std::env::current_exe().unwrap_or_else(|_| args[0].clone().into());
        let code = match complete::answer(command::<P>(), values, &exe, &words) {
            Some(found) => {
                let mut text = String::new();
                for v in found {
                    text.push_str(&v);
                    text.push('\n');
                }
                match io::stdout().lock().write_all(text.as_bytes()) {
                    Ok(()) => 0,
                    Err(_) => 1,
                }
            }
            None => 1,
        };
        std::process::exit(code)
    }
    match try_parse_from_with::<P, _, _>(args, values) {
        Ok(Parsed::Run(p)) => p,
        Ok(Parsed::Generated(out)) => {
            let code = match io::stdout().lock().write_all(&out) {
                Ok(()) => 0,
                Err(_) => 1,
            };
            std::process::exit(code)
        }
        Err(e) => e.exit(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Subcommand;

    /// A command like vgpuctl's: global options and a required subcommand.
    #[derive(Debug, Parser)]
    #[command(name = "demo", version, about = "A demo")]
    struct Demo {
        #[arg(long, default_value = "/run/x")]
        control: String,
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(Debug, Subcommand)]
    enum Cmd {
        /// Lists.
        List,
        /// Sets.
        Set { vm: String, params: Vec<String> },
    }

    fn run(args: &[&str]) -> Result<Parsed<Demo>, clap::Error> {
        try_parse_from::<Demo, _, _>(std::iter::once("demo").chain(args.iter().copied()))
    }

    #[test]
    fn equals_form_and_subcommands_parse() {
        let Ok(Parsed::Run(d)) = run(&["--control=/tmp/c", "set", "a", "x=1"]) else {
            panic!("not parsed")
        };
        assert_eq!(d.control, "/tmp/c");
        assert!(
            matches!(d.cmd, Cmd::Set { ref vm, ref params } if vm == "a" && params == &["x=1"])
        );
    }

    #[test]
    fn completions_and_man_stand_alone() {
        let Ok(Parsed::Generated(bash)) = run(&["--completions", "bash"]) else {
            panic!("no completions")
        };
        let bash = String::from_utf8(bash).unwrap();
        assert!(
            bash.contains("_demo") && bash.contains("--control"),
            "{bash}"
        );
        let Ok(Parsed::Generated(man)) = run(&["--man"]) else {
            panic!("no man page")
        };
        let man = String::from_utf8(man).unwrap();
        assert!(man.starts_with(".ie") || man.contains(".TH"), "{man}");
        assert!(man.contains("demo") && man.contains("control"));
    }

    #[test]
    fn the_demo_keeps_the_conventions() {
        check::conventions::<Demo>(env!("CARGO_PKG_VERSION")).unwrap();
        #[derive(Debug, Parser)]
        #[command(name = "noversion")]
        struct NoVersion {
            #[arg(long)]
            x: bool,
        }
        assert!(check::conventions::<NoVersion>("0.1.0").is_err());
        // The demo writes no EXAMPLES, FILES or SEE ALSO.
        let e = check::operator_man_page::<Demo>().unwrap_err();
        assert!(e.contains("no EXAMPLES section"), "{e}");
        #[derive(Debug, Parser)]
        #[command(
            name = "tool",
            version,
            after_long_help = "EXAMPLES\n  tool --x\n\nFILES\n  /etc/tool\n\nSEE ALSO\nvgpuctl(1)"
        )]
        struct Tool {
            #[arg(long)]
            x: bool,
        }
        check::operator_man_page::<Tool>().unwrap();
        let d: Demo = check::arguments(["--control", "/c", "list"]).unwrap();
        assert_eq!(d.control, "/c");
        assert!(check::arguments::<Demo, _, _>(["--man"]).is_err());
        assert!(check::arguments::<Demo, _, _>(["--bogus"]).is_err());
    }

    #[test]
    fn usage_errors_are_refused() {
        // The subcommand is still required when no generator is asked for.
        assert!(run(&[]).is_err());
        assert!(run(&["--completions", "nosuchshell"]).is_err());
        assert!(run(&["--man", "list"]).is_err());
        assert!(run(&["--bogus", "list"]).is_err());
        let e = run(&["--version"]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayVersion);
    }
}
