//! Completion of values that only the running system knows (the VMs a daemon knows, the vGPU
//! types in a config directory), which a completion script generated once cannot list.
//!
//! A binary names such arguments in a table of [`Values`], each with the queries (its own
//! command lines, e.g. `list --names`) that print them one per line. The bash, zsh and fish
//! scripts of `--completions` then ask the binary first, as cobra's and clap's dynamic
//! completions do: `NAME __complete WORD... CURRENT` (the words after NAME up to the cursor,
//! the last one the word being completed, maybe empty). Where that word is one of the table's
//! arguments, the binary runs the queries (the global options typed before, such as
//! `--control PATH`, passed on), prints the values that start with it and exits 0; the script
//! offers exactly those, nothing when a query fails (a daemon that is not running): no error
//! text, and each query is bounded by [`QUERY_TIMEOUT`]. Anywhere else it exits 1 and the
//! script completes as the generated static one does (options, subcommands, file names).

use std::io::Read;
use std::path::Path;
use std::process::{Command as Process, Stdio};
use std::time::{Duration, Instant};

use clap::{Arg, Command};
use clap_complete::Shell;

/// The hidden first argument of the question a completion script asks its binary.
pub const COMPLETE: &str = "__complete";

/// How long one query may run: a live daemon answers in milliseconds, a hung one (or a socket
/// nobody accepts on) must not hang the shell, which then offers nothing.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// The most a query may print that is read (thousands of names).
pub const MAX_QUERY_BYTES: u64 = 1 << 20;

/// How often a running query is checked for its exit.
const QUERY_POLL: Duration = Duration::from_millis(5);

/// An argument whose values the binary prints when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Values {
    /// The subcommand whose argument it is.
    pub subcommand: &'static str,
    /// The argument's id (the clap derive field's name): a positional or an option.
    pub arg: &'static str,
    /// Command lines (after the binary's name and the global options typed) that print the
    /// values, one per line; their values are offered together, sorted, each once. A query
    /// that fails or runs past [`QUERY_TIMEOUT`] adds none.
    pub queries: &'static [&'static [&'static str]],
}

/// The argument the word under the cursor is a value of, when the table names it.
#[derive(Debug, PartialEq, Eq)]
pub struct Wanted<'t> {
    /// The table's entry.
    pub values: &'t Values,
    /// The global options with values typed before the word (`--control=PATH`), to pass on.
    pub globals: Vec<String>,
    /// The word so far.
    pub current: String,
}

/// The argument of `scope` with long name `long`.
fn find_long<'c>(scope: &'c Command, long: &str) -> Option<&'c Arg> {
    scope.get_arguments().find(|a| {
        a.get_long() == Some(long)
            || a.get_all_aliases()
                .is_some_and(|aliases| aliases.contains(&long))
    })
}

fn takes_value(arg: &Arg) -> bool {
    arg.get_action().takes_values()
}

/// Which argument of `cmd` (built: [`Command::build`]) `words` (after the binary's name, the
/// last the word being completed) complete, if `table` names it; `None` where the static
/// completions apply (an option's name, a subcommand's, an argument not in the table, anything
/// after `--`).
pub fn wanted<'t>(cmd: &Command, table: &'t [Values], words: &[String]) -> Option<Wanted<'t>> {
    let (current, done) = words.split_last()?;
    if current.starts_with('-') {
        return None;
    }
    let mut scope = cmd;
    let mut sub: Option<&Command> = None;
    let mut positionals = 0usize;
    let mut globals = Vec::new();
    // The option whose value the next word is.
    let mut pending: Option<&Arg> = None;
    let mut i = 0;
    while let Some(word) = done.get(i) {
        i += 1;
        if let Some(arg) = pending.take() {
            if arg.is_global_set()
                && let Some(long) = arg.get_long()
            {
                globals.push(format!("--{long}={word}"));
            }
            continue;
        }
        if word == "--" {
            return None;
        }
        if let Some(long) = word.strip_prefix("--") {
            let (name, inline) = match long.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (long, None),
            };
            let Some(arg) = find_long(scope, name).filter(|a| takes_value(a)) else {
                continue;
            };
            match inline {
                Some(value) => {
                    if arg.is_global_set() {
                        globals.push(format!("--{name}={value}"));
                    }
                }
                // bash splits `--opt=value` into `--opt`, `=` and `value`.
                None if done.get(i).is_some_and(|w| w == "=") => {
                    i += 1;
                    pending = Some(arg);
                }
                None => pending = Some(arg),
            }
            continue;
        }
        if let Some(shorts) = word.strip_prefix('-').filter(|s| !s.is_empty()) {
            // A cluster of flags, the last of which may take the next word as its value
            // (one taking a value earlier in the cluster takes the rest of it).
            for (at, c) in shorts.char_indices() {
                let arg = scope.get_arguments().find(|a| a.get_short() == Some(c));
                if let Some(arg) = arg.filter(|a| takes_value(a)) {
                    if at + c.len_utf8() == shorts.len() {
                        pending = Some(arg);
                    }
                    break;
                }
            }
            continue;
        }
        match sub {
            None => {
                sub = Some(scope.find_subcommand(word)?);
                scope = sub?;
            }
            Some(_) => positionals = positionals.saturating_add(1),
        }
    }
    let sub = sub?;
    let arg = match pending {
        Some(option) => option,
        None => nth_positional(sub, positionals)?,
    };
    let values = table
        .iter()
        .find(|v| v.subcommand == sub.get_name() && v.arg == arg.get_id().as_str())?;
    Some(Wanted {
        values,
        globals,
        current: current.clone(),
    })
}

/// The positional argument of `sub` that the `n`th (from 0) plain word after it fills.
fn nth_positional(sub: &Command, n: usize) -> Option<&Arg> {
    let mut positionals: Vec<&Arg> = sub.get_positionals().filter(|a| !a.is_last_set()).collect();
    positionals.sort_by_key(|a| a.get_index());
    let mut left = n;
    for arg in positionals {
        let takes = arg.get_num_args().map_or(1, |r| r.max_values());
        if left < takes {
            return Some(arg);
        }
        left -= takes;
    }
    None
}

/// The values for `wanted`: every query's lines that start with the word so far, run as `exe`
/// with the global options typed, sorted, each once.
pub fn values(exe: &Path, wanted: &Wanted) -> Vec<String> {
    let mut found: Vec<String> = wanted
        .values
        .queries
        .iter()
        .flat_map(|q| query(exe, &wanted.globals, q))
        .filter(|v| !v.is_empty() && v.starts_with(&wanted.current))
        .collect();
    found.sort();
    found.dedup();
    found
}

/// The lines `exe GLOBALS QUERY` prints, or none when it fails or runs past [`QUERY_TIMEOUT`]
/// (then it is killed). Its stderr goes nowhere: a completion prints no errors.
fn query(exe: &Path, globals: &[String], query: &[&str]) -> Vec<String> {
    let Ok(mut child) = Process::new(exe)
        .args(globals)
        .args(query)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return Vec::new();
    };
    // Read on a thread, so that a full pipe cannot stall the query past its deadline.
    let reader = child.stdout.take().map(|out| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = out.take(MAX_QUERY_BYTES).read_to_string(&mut text);
            text
        })
    });
    let deadline = Instant::now() + QUERY_TIMEOUT;
    let ok = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status.success(),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(QUERY_POLL),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                break false;
            }
        }
    };
    let text = reader.and_then(|r| r.join().ok()).unwrap_or_default();
    if !ok {
        return Vec::new();
    }
    text.lines().map(str::to_owned).collect()
}

/// Answers a completion script's question (`words`, after [`COMPLETE`]) for the command
/// `cmd` of the binary `exe`: the values to print, or `None` where the static completions
/// apply.
pub fn answer(
    mut cmd: Command,
    table: &[Values],
    exe: &Path,
    words: &[String],
) -> Option<Vec<String>> {
    cmd.build();
    let wanted = wanted(&cmd, table, words)?;
    Some(values(exe, &wanted))
}

/// `script`, `shell`'s static completions of `cmd`, changed so that it asks the binary
/// where [`answer`] has values for `table`: the script itself for shells without such a hook
/// (elvish, PowerShell). An error where the generated script does not have the shape the hook
/// hooks into (a clap_complete that changed).
pub fn hooked(
    shell: Shell,
    cmd: &Command,
    table: &[Values],
    script: String,
) -> Result<String, String> {
    let name = cmd.get_name();
    match shell {
        Shell::Bash => bash(name, script),
        Shell::Zsh => zsh(name, script),
        Shell::Fish => {
            let longs: Vec<&str> = table
                .iter()
                .filter_map(|v| {
                    let sub = cmd.find_subcommand(v.subcommand)?;
                    let arg = sub.get_arguments().find(|a| a.get_id() == v.arg)?;
                    arg.get_long()
                })
                .collect();
            Ok(fish(name, &longs, script))
        }
        _ => Ok(script),
    }
}

/// bash: a function that asks the binary and otherwise calls the static one, registered in
/// its place (with the same options; where it has values, `compopt` drops the fallback to
/// file names, so that no values offers nothing).
fn bash(name: &str, script: String) -> Result<String, String> {
    let registered = |line: &str| {
        let rest = line.trim().strip_prefix("complete -F ")?;
        rest.split_whitespace().next().map(str::to_owned)
    };
    let f = script
        .lines()
        .find_map(registered)
        .ok_or_else(|| format!("the bash completions of {name} register no function"))?;
    let hook = format!("{f}_values");
    let mut out = script.replace(
        &format!("complete -F {f} "),
        &format!("complete -F {hook} "),
    );
    out.push_str(&format!(
        r#"
# Values only the running system knows (VMs, types): asked of {name} itself
# (`{name} {COMPLETE} WORD... CURRENT`); everything else as above.
{hook}() {{
    local cur out
    if [[ "${{BASH_VERSINFO[0]}}" -ge 4 ]]; then
        cur="$2"
    else
        cur="${{COMP_WORDS[COMP_CWORD]}}"
    fi
    if out=$("${{COMP_WORDS[0]}}" {COMPLETE} "${{COMP_WORDS[@]:1:COMP_CWORD-1}}" "$cur" 2>/dev/null); then
        compopt +o default +o bashdefault 2>/dev/null
        COMPREPLY=()
        [[ -z "$out" ]] || mapfile -t COMPREPLY <<<"$out"
        return 0
    fi
    {f} "$@"
}}
"#
    ));
    Ok(out)
}

/// zsh: the static function is renamed, and a function of its name asks the binary first
/// (defined before the script's last lines, which call or register it).
fn zsh(name: &str, script: String) -> Result<String, String> {
    let f = format!("_{name}");
    let head = format!("\n{f}() {{\n");
    let tail = format!("if [ \"$funcstack[1]\" = \"{f}\" ]; then");
    let (Some(at_head), Some(at_tail)) = (script.find(&head), script.rfind(&tail)) else {
        return Err(format!("the zsh completions of {name} have no {f} to hook"));
    };
    if at_tail < at_head {
        return Err(format!("the zsh completions of {name} end before {f}"));
    }
    let hook = format!(
        r#"# Values only the running system knows (VMs, types): asked of {name} itself
# (`{name} {COMPLETE} WORD... CURRENT`); everything else by {f}_static.
{f}() {{
    local out
    if out=$("${{(Q)words[1]}}" {COMPLETE} "${{(@Q)words[2,CURRENT-1]}}" "${{(Q)PREFIX}}" 2>/dev/null); then
        local -a values
        values=(${{(f)out}})
        compadd -a values
        return
    fi
    {f}_static "$@"
}}

"#
    );
    let mut out = String::with_capacity(script.len() + hook.len());
    out.push_str(&script[..at_head]);
    out.push_str(&format!("\n{f}_static() {{\n"));
    out.push_str(&script[at_head + head.len()..at_tail]);
    out.push_str(&hook);
    out.push_str(&script[at_tail..]);
    Ok(out)
}

/// fish: one more completion whose condition asks the binary (keeping the values for its
/// arguments, so the binary is asked once) and which then offers only them, no file names; one
/// per option among `longs` too (fish completes an option's value by the option's own rules).
fn fish(name: &str, longs: &[&str], mut script: String) -> String {
    let f = format!("__fish_{}_values", name.replace('-', "_"));
    script.push_str(&format!(
        r#"
# Values only the running system knows (VMs, types): asked of {name} itself
# (`{name} {COMPLETE} WORD... CURRENT`); everything else as above.
function {f}
    set -l words (commandline -opc)
    set -l cmd $words[1]
    set -e words[1]
    command -q -- $cmd
    or return 1
    set -g {f} ($cmd {COMPLETE} $words (commandline -ct) 2>/dev/null)
end
complete -c {name} -n {f} -f -a '${f}'
"#
    ));
    for long in longs {
        script.push_str(&format!(
            "complete -c {name} -n {f} -l {long} -r -f -a '${f}'\n"
        ));
    }
    script
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Parser, Subcommand};

    #[derive(Debug, Parser)]
    #[command(name = "demo")]
    struct Demo {
        #[arg(long, global = true, default_value = "/run/x")]
        control: String,
        #[arg(long, global = true)]
        json: bool,
        #[arg(short = 'c', long, global = true)]
        config_dir: Option<String>,
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(Debug, Subcommand)]
    enum Cmd {
        Show {
            vm: Option<String>,
            #[arg(long)]
            watch: Option<u32>,
        },
        Define {
            name: String,
            #[arg(long = "type")]
            vgpu_type: Option<String>,
            params: Vec<String>,
            #[arg(last = true)]
            options: Vec<String>,
        },
        Set {
            vm: String,
            params: Vec<String>,
        },
    }

    const VMS: &[&str] = &["list", "--names"];
    const TABLE: &[Values] = &[
        Values {
            subcommand: "show",
            arg: "vm",
            queries: &[VMS],
        },
        Values {
            subcommand: "set",
            arg: "vm",
            queries: &[VMS],
        },
        Values {
            subcommand: "define",
            arg: "vgpu_type",
            queries: &[&["types"]],
        },
    ];

    fn ask(line: &[&str]) -> Option<(&'static str, &'static str, Vec<String>, String)> {
        let mut cmd = crate::command::<Demo>();
        cmd.build();
        let words: Vec<String> = line.iter().map(|w| (*w).to_owned()).collect();
        wanted(&cmd, TABLE, &words)
            .map(|w| (w.values.subcommand, w.values.arg, w.globals, w.current))
    }

    #[test]
    fn the_table_s_arguments_are_found_where_they_are_typed() {
        let none: Vec<String> = Vec::new();
        assert_eq!(
            ask(&["show", ""]),
            Some(("show", "vm", none.clone(), String::new()))
        );
        assert_eq!(
            ask(&["show", "vm"]),
            Some(("show", "vm", none.clone(), "vm".into()))
        );
        assert_eq!(
            ask(&["set", "a"]),
            Some(("set", "vm", none.clone(), "a".into()))
        );
        // Options before the positional, with and without values.
        assert_eq!(
            ask(&["show", "--watch", "5", "--json", ""]).map(|w| w.1),
            Some("vm")
        );
        assert_eq!(
            ask(&["define", "new", "--type", "sm"]).map(|w| w.1),
            Some("vgpu_type")
        );
        assert_eq!(
            ask(&["define", "--type", ""]).map(|w| w.1),
            Some("vgpu_type")
        );
        // Global options with values are passed on, in all three spellings (bash splits `=`).
        let globals = vec![
            "--control=/tmp/c".to_owned(),
            "--config-dir=/etc/x".to_owned(),
        ];
        assert_eq!(
            ask(&["--control", "/tmp/c", "show", "-c", "/etc/x", ""]).map(|w| w.2),
            Some(globals.clone())
        );
        assert_eq!(
            ask(&[
                "--control=/tmp/c",
                "--json",
                "show",
                "--config-dir",
                "=",
                "/etc/x",
                ""
            ])
            .map(|w| w.2),
            Some(globals)
        );
    }

    #[test]
    fn elsewhere_the_static_completions_apply() {
        for line in [
            &[""][..],
            &["sh"],
            &["show", "-"],
            &["show", "--wa"],
            &["show", "--watch", ""],
            &["show", "vm1", ""],
            &["define", ""],
            &["define", "new", ""],
            &["define", "new", "--", ""],
            &["set", "vm1", "prio"],
            &["nosuch", ""],
            &["--control", ""],
            &[],
        ] {
            assert_eq!(ask(line), None, "{line:?}");
        }
    }

    #[test]
    fn queries_are_bounded_and_quiet() {
        let values = Values {
            subcommand: "show",
            arg: "vm",
            queries: &[
                &[
                    "-c",
                    "echo vm2; echo vm1; echo other; echo vm1; echo oops >&2",
                ],
                &["-c", "echo vm3; exit 3"],
            ],
        };
        let wanted = Wanted {
            values: &values,
            globals: Vec::new(),
            current: "vm".into(),
        };
        // Sorted, each once, only those that start with the word; a failing query adds none.
        assert_eq!(super::values(Path::new("sh"), &wanted), ["vm1", "vm2"]);
        let hung = Values {
            queries: &[&["-c", "echo vm1; exec sleep 60"]],
            ..values
        };
        let wanted = Wanted {
            values: &hung,
            ..wanted
        };
        assert!(super::values(Path::new("sh"), &wanted).is_empty());
        let missing = Path::new("/nonexistent/demo");
        assert!(super::values(missing, &wanted).is_empty());
    }

    #[test]
    fn every_shell_with_a_hook_gets_it() {
        for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
            let mut cmd = crate::command::<Demo>();
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "demo", &mut script);
            let script = String::from_utf8(script).unwrap();
            let out = hooked(shell, &cmd, TABLE, script).unwrap();
            assert!(
                out.contains("demo __complete WORD... CURRENT"),
                "{shell}: {out}"
            );
            if shell == Shell::Fish {
                assert!(out.contains("-n __fish_demo_values -l type -r -f"), "{out}");
            }
        }
        crate::check::completion_values::<Demo>(TABLE).unwrap();
        for (subcommand, arg) in [("nosuch", "vm"), ("show", "nosuch"), ("define", "options")] {
            let bad = [Values {
                subcommand,
                arg,
                queries: &[VMS],
            }];
            let e = crate::check::completion_values::<Demo>(&bad).unwrap_err();
            assert!(e.contains(subcommand), "{e}");
        }
        let flag = [Values {
            subcommand: "show",
            arg: "json",
            queries: &[VMS],
        }];
        assert!(crate::check::completion_values::<Demo>(&flag).is_err());
        let cmd = crate::command::<Demo>();
        assert!(hooked(Shell::Bash, &cmd, TABLE, "_demo() { :; }\n".into()).is_err());
        assert!(hooked(Shell::Zsh, &cmd, TABLE, "#compdef demo\n".into()).is_err());
    }
}
