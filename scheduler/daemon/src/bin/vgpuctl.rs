//! `vgpuctl [--control PATH] [--json] [--config-dir DIR] COMMAND`: the control CLI of
//! `vgpu-schedd`. Exit codes: 0 ok; 1 the request was refused, by the daemon or by the same
//! checks run here first (an unknown VM, key or definition, a value out of range, a policy
//! file that is not one); 2 the command line does not parse, or the daemon cannot be reached.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use serde_json::{Map, Value, json};
use uuid::Uuid;
use vgpu_schedd::client::{
    Align, Conn, Failure, cell, latency_cell, memory_cell, only_vm, param_text, policy_cell, table,
};
use vgpu_schedd::control::{
    DEFAULT_CONTROL_PATH, ServerOptions, parse_assignments, read_policy_file,
};
use vgpu_schedd::definitions::{DEFAULT_CONFIG_DIR, Definition, ListedType, Store};

/// Longest `--watch` or `top --interval` (a day).
const MAX_WATCH_SECONDS: f64 = 86_400.0;
/// Shortest `top --interval`: a redraw more often than this only flickers.
const MIN_TOP_SECONDS: f64 = 0.1;
/// Clears a terminal and puts the cursor home (`top` redraws in place).
const CLEAR_SCREEN: &str = "\x1b[H\x1b[2J";

/// The control CLI of vgpu-schedd.
#[derive(Debug, Parser)]
#[command(
    name = "vgpuctl",
    version,
    about = "The control CLI of vgpu-schedd: VMs, statistics, policy, parameters, device \
             processes and persistent vGPU definitions",
    after_help = "Exit codes: 0 ok; 1 the request was refused (by the daemon, or by the same \
                  checks run before asking it: unknown VM, key or definition, a value out of \
                  range); 2 the command line does not parse, or the daemon cannot be reached.",
    after_long_help = "EXIT STATUS
0 ok; 1 the request was refused (by the daemon, or by the same checks run before asking it:
unknown VM, key or definition, a value out of range); 2 the command line does not parse, or
the daemon cannot be reached (the message says why: no socket, a stale one, or permission
denied, with the socket's owner, mode and the group whose members may use it).

EXAMPLES
  vgpuctl types
  vgpuctl define vm1 --type quarter --socket /run/vgpu-schedd/vms/vm1.sock priority=3
  vgpuctl start vm1
  vgpuctl show vm1
  vgpuctl set --both vm1 weight=512 target_fps=60
  vgpuctl set-policy timegraph.toml
  vgpuctl stop vm1
  vgpuctl --completions bash > /usr/share/bash-completion/completions/vgpuctl

SHELL COMPLETION
The bash, zsh and fish scripts of --completions also complete names: the VMs the daemon
knows for show, top, focus, forget, stop and destroy, the definitions for start, modify and
undefine, both for set, and the types for define --type. They ask vgpuctl, which runs
list --names, list --defined --names and types --names (one name a line; scripts may run
them too) with the --control and --config-dir on the line. When the daemon does not answer
within 2 s, or not at all, nothing is offered and nothing printed.

FILES
  /run/vgpu-schedd/control.sock
  /etc/vgpu/vgpus/NAME.json
  /etc/vgpu/types/TYPE.json
  /etc/vgpu/live.json

The control socket is the daemon's (--control); definitions and types live in the config
directory (--config-dir), where the daemon also keeps the live policy and parameters.

SEE ALSO
vgpu-schedd(1), vgpu-smi(1), vgpu-server(1); docs/OPERATIONS.md in the source tree."
)]
struct Cli {
    /// The daemon's control socket.
    #[arg(long, global = true, value_name = "PATH", default_value = DEFAULT_CONTROL_PATH)]
    control: PathBuf,
    /// Print the daemon's raw answers (JSON, one per line) instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Where persistent definitions live (DIR/vgpus/NAME.json).
    #[arg(long, global = true, value_name = "DIR", default_value = DEFAULT_CONFIG_DIR)]
    config_dir: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// VMs, their vGPUs and the parameters in force (* where the policy overrides the VM's
    /// own), the policy, the device processes the daemon started.
    List {
        /// List the persistent definitions instead, and whether each is running.
        #[arg(long)]
        defined: bool,
        /// Print only the names, one per line, sorted (with --json one array): the VMs the
        /// daemon knows and its device processes, or with --defined the definitions (for
        /// scripts and the shell completions).
        #[arg(long)]
        names: bool,
    },
    /// Live statistics: GPU share, frame rate, latency, queue and each VM's standing under the
    /// policy (one table, or one every --watch seconds).
    Show {
        /// Only this VM (refused, with the VMs known, when the daemon does not know it).
        vm: Option<String>,
        /// Repeat every SECONDS.
        #[arg(long, value_name = "SECONDS", value_parser = watch_interval)]
        watch: Option<Duration>,
        /// Stop after N tables (with --watch).
        #[arg(long, value_name = "N", requires = "watch", value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
    },
    /// Live statistics refreshed in place on a terminal (successive tables otherwise) until
    /// Ctrl-C or --count.
    Top {
        /// Only this VM (refused, with the VMs known, when the daemon does not know it).
        vm: Option<String>,
        /// Seconds between refreshes.
        #[arg(long, value_name = "SECONDS", default_value = "1", value_parser = top_interval)]
        interval: Duration,
        /// Stop after N refreshes.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
    },
    /// Install a policy from a TOML file (policy = "timegraph" | "fair" | "pegasus" | "vgris" |
    /// "none", with its family's fields).
    SetPolicy {
        /// The policy file.
        file: PathBuf,
    },
    /// Change a VM's scheduling parameters: priority, weight, sched=prt|ht, target_fps,
    /// slo=µs/s, reserve=C_us/T_us/pe|ae. As virsh: --live changes the running VM (kept by the
    /// daemon across its restarts), --config its definition (used at its next start), --both
    /// both; without either, the running VM if it runs (connected or with a device process),
    /// else its definition if it has one, else the VM the daemon keeps parameters for.
    Set {
        /// The VM.
        vm: String,
        /// Change the running VM's parameters.
        #[arg(long, conflicts_with_all = ["config", "both"])]
        live: bool,
        /// Change the VM's definition.
        #[arg(long, conflicts_with = "both")]
        config: bool,
        /// Change both the running VM's parameters and its definition.
        #[arg(long)]
        both: bool,
        /// Keep the parameters for a VM the daemon does not know yet (it gets them when it
        /// connects); without it an unknown name is refused.
        #[arg(long, conflicts_with = "config")]
        add: bool,
        /// The parameters to change.
        #[arg(required = true, value_name = "KEY=VALUE")]
        params: Vec<String>,
    },
    /// Drop the parameters the daemon keeps for a VM that is not connected and has no device
    /// process (a VM gone for good, or one an older vgpuctl added by a mistyped name).
    Forget {
        /// The VM.
        vm: String,
    },
    /// Tell the daemon the user looks at VM.
    Focus {
        /// The VM.
        vm: String,
    },
    /// Start a vgpu-server for NAME through the daemon. OPTIONS: --display WxH,
    /// --renderer virgl|none, --log-level LEVEL, --memory-mb N (its memory budget, GPU memory
    /// included), --exit-on-disconnect, --dump (scanouts into the daemon's
    /// STATE_DIR/dump/NAME/).
    Create {
        /// The VM's name.
        name: String,
        /// The vfio-user socket the device serves.
        #[arg(long, value_name = "PATH")]
        socket: PathBuf,
        /// Options for the device process.
        #[arg(last = true, value_name = "OPTIONS")]
        options: Vec<String>,
    },
    /// Stop the vgpu-server the daemon started for NAME.
    Destroy {
        /// The VM's name.
        name: String,
    },
    /// Print the address of the daemon's live web dashboard (with its access token).
    Dashboard,
    /// The vGPU types (CONFIG_DIR/types/TYPE.json): each type's parameters, device options
    /// (memory), how many vGPUs of it may be defined and how many are free.
    Types {
        /// Print only the names of the types a definition can use, one per line (with --json
        /// one array).
        #[arg(long)]
        names: bool,
    },
    /// Define a persistent vGPU (CONFIG_DIR/vgpus/NAME.json): its socket, device options and
    /// scheduling parameters; `start` creates it, and the daemon starts it at boot with --auto.
    Define {
        /// The vGPU's (and VM's) name: ASCII letters, digits, '_', '-', '.'.
        name: String,
        /// The vfio-user socket its device serves.
        #[arg(long, value_name = "PATH")]
        socket: PathBuf,
        /// Define it as an instance of vGPU type TYPE (`types`): the type's parameters and
        /// device options, with KEY=VALUE over its parameters and OPTIONS after its options.
        /// Refused when every instance of the type is defined.
        #[arg(long = "type", value_name = "TYPE")]
        vgpu_type: Option<String>,
        /// Start it whenever vgpu-schedd starts (vgpu-schedd --config-dir).
        #[arg(long)]
        auto: bool,
        /// Scheduling parameters, as `set` takes them.
        #[arg(value_name = "KEY=VALUE")]
        params: Vec<String>,
        /// Options for the device process, as `create` takes them.
        #[arg(last = true, value_name = "OPTIONS")]
        options: Vec<String>,
    },
    /// Change a persistent definition (as mdevctl modify): the fields given replace the
    /// definition's; its parameters are merged (as `set --config`); device OPTIONS, when given,
    /// replace the old ones. Checked as `define` checks; a running device process is not
    /// changed (`stop` and `start` it, or `set --live`).
    Modify {
        /// The vGPU's name.
        name: String,
        /// A new vfio-user socket.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Start it whenever vgpu-schedd starts.
        #[arg(long, conflicts_with = "no_auto")]
        auto: bool,
        /// Do not start it when vgpu-schedd starts.
        #[arg(long)]
        no_auto: bool,
        /// Drop every device option (before any new OPTIONS are taken).
        #[arg(long)]
        clear_options: bool,
        /// Scheduling parameters to change, as `set` takes them.
        #[arg(value_name = "KEY=VALUE")]
        params: Vec<String>,
        /// New options for the device process, as `create` takes them.
        #[arg(last = true, value_name = "OPTIONS")]
        options: Vec<String>,
    },
    /// Remove a persistent definition (a running device process keeps running; `stop` still
    /// stops it).
    Undefine {
        /// The vGPU's name.
        name: String,
    },
    /// Start a defined vGPU: apply its parameters, then create its device process.
    Start {
        /// The vGPU's name.
        name: String,
    },
    /// Stop a vGPU's device process (its definition, if any, stays).
    Stop {
        /// The vGPU's name.
        name: String,
    },
}

fn seconds(text: &str, min: f64) -> Result<Duration, String> {
    text.parse()
        .ok()
        .filter(|s: &f64| s.is_finite() && *s >= min && *s > 0.0 && *s <= MAX_WATCH_SECONDS)
        .map(Duration::from_secs_f64)
        .ok_or(format!(
            "{text:?} is not a number of seconds in ({min}, {MAX_WATCH_SECONDS}]"
        ))
}

fn watch_interval(text: &str) -> Result<Duration, String> {
    seconds(text, 0.0)
}

fn top_interval(text: &str) -> Result<Duration, String> {
    seconds(text, MIN_TOP_SECONDS)
}

/// Appended to a `list` value that the policy applies in place of the VM's own.
const POLICY_MARK: char = '*';
/// What [`POLICY_MARK`] means, printed under the `list` table when a value carries it.
const POLICY_LEGEND: &str =
    "* set by the policy (spec lines, focus, its defaults, admission control), not by `set`";

/// `yes` / `no` for a flag.
fn yes_no(v: Option<&Value>) -> String {
    if v.and_then(Value::as_bool).unwrap_or(false) {
        "yes".into()
    } else {
        "no".into()
    }
}

/// The lines of `vgpuctl list`: the parameters in the units and syntax `set` takes.
fn list_lines(v: &Value) -> Vec<String> {
    let policy = v.get("policy").and_then(|p| p.get("policy"));
    let mut lines = vec![format!("policy: {}", cell(policy))];
    let empty = Vec::new();
    let vms = v.get("vms").and_then(Value::as_array).unwrap_or(&empty);
    let mut marked = false;
    let mut rows: Vec<Vec<String>> = Vec::with_capacity(vms.len());
    for vm in vms {
        // What the policy applies; a VM that is away has only its own parameters.
        let own = vm.get("params");
        let applied = vm.get("effective").filter(|e| !e.is_null()).or(own);
        let mut show = |key: &str| {
            let text = param_text(key, applied.and_then(|a| a.get(key)));
            if applied.and_then(|a| a.get(key)) == own.and_then(|p| p.get(key)) {
                text
            } else {
                marked = true;
                format!("{text}{POLICY_MARK}")
            }
        };
        rows.push(vec![
            cell(vm.get("name")),
            cell(vm.get("vgpu")),
            yes_no(vm.get("connected")),
            cell(vm.get("device_pid")),
            cell(vm.get("qemu_pid")),
            show("priority"),
            show("weight"),
            show("sched"),
            show("reserve"),
            show("slo"),
            show("target_fps"),
        ]);
    }
    use Align::{Left, Right};
    lines.extend(table(
        &[
            ("VM", Left),
            ("vGPU", Right),
            ("connected", Left),
            ("pid", Right),
            ("qemu", Right),
            ("priority", Right),
            ("weight", Right),
            ("sched", Left),
            ("reserve C/T µs", Left),
            ("slo µs/s", Right),
            ("fps target", Right),
        ],
        &rows,
    ));
    if marked {
        lines.push(POLICY_LEGEND.to_owned());
    }
    let children = v
        .get("children")
        .and_then(Value::as_array)
        .unwrap_or(&empty);
    if !children.is_empty() {
        lines.push(String::new());
        let rows: Vec<Vec<String>> = children
            .iter()
            .map(|c| {
                vec![
                    cell(c.get("name")),
                    cell(c.get("pid")),
                    cell(c.get("socket")),
                ]
            })
            .collect();
        lines.extend(table(
            &[("device process", Left), ("pid", Right), ("socket", Left)],
            &rows,
        ));
    }
    lines
}

/// The lines of `vgpuctl show` for a `stats` answer.
fn stats_lines(v: &Value) -> Vec<String> {
    let policy = v.get("policy").and_then(Value::as_str).unwrap_or("-");
    let busy = v.get("engine_busy").and_then(Value::as_f64).unwrap_or(0.0) * 100.0;
    let empty = Vec::new();
    let vms = v.get("vms").and_then(Value::as_array).unwrap_or(&empty);
    let no_figures = Map::new();
    let rows: Vec<Vec<String>> = vms
        .iter()
        .map(|vm| {
            let num = |k| vm.get(k).and_then(Value::as_f64).unwrap_or(0.0);
            let connected = vm.get("connected").and_then(Value::as_bool) == Some(true);
            let live = |text: String| if connected { text } else { "-".into() };
            let figures = vm
                .get("figures")
                .and_then(Value::as_object)
                .unwrap_or(&no_figures);
            vec![
                cell(vm.get("name")),
                cell(vm.get("vgpu")),
                (if connected { "connected" } else { "away" }).into(),
                live(format!("{:.1} %", num("gpu_share") * 100.0)),
                live(format!("{:.1} fps", num("fps"))),
                live(format!("{:.1}/s", num("groups_per_sec"))),
                live(cell(vm.get("queue_depth"))),
                live(cell(vm.get("in_flight"))),
                live(latency_cell(num("latency_p50_us"), num("latency_p99_us"))),
                memory_cell(
                    vm.get("memory_used_bytes").and_then(Value::as_u64),
                    vm.get("memory_limit_bytes").and_then(Value::as_u64),
                ),
                policy_cell(policy, figures),
            ]
        })
        .collect();
    use Align::{Left, Right};
    let mut lines = vec![format!(
        "policy: {policy}  engine busy: {busy:.1} %  VMs: {}",
        vms.len()
    )];
    lines.extend(table(
        &[
            ("VM", Left),
            ("vGPU", Right),
            ("state", Left),
            ("GPU share", Right),
            ("frame rate", Right),
            ("groups", Right),
            ("queue", Right),
            ("in flight", Right),
            ("latency p50/p99", Right),
            ("memory", Right),
            ("policy", Left),
        ],
        &rows,
    ));
    lines
}

/// A definition's parameters as `define` takes them (`priority=3 reserve=2000/10000/pe`), `-`
/// for none.
fn params_summary(params: &std::collections::BTreeMap<String, Value>) -> String {
    let parts: Vec<String> = params
        .iter()
        .map(|(k, v)| format!("{k}={}", param_text(k, Some(v))))
        .collect();
    if parts.is_empty() {
        "-".into()
    } else {
        parts.join(" ")
    }
}

/// What `list --defined` knows of one definition.
struct DefinedRow {
    name: String,
    /// The definition, or why its file is not one.
    definition: Result<Definition, String>,
    /// The pid of its device process, if the daemon runs one.
    pid: Option<u64>,
}

/// The lines of `vgpuctl list --defined`; `daemon_known` is false when the daemon could not be
/// asked what runs.
fn defined_lines(rows: &[DefinedRow], daemon_known: bool) -> Vec<String> {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let state = match (&r.definition, r.pid) {
                (_, Some(pid)) => format!("running (pid {pid})"),
                (Err(_), None) => "broken".into(),
                (Ok(_), None) if daemon_known => "stopped".into(),
                (Ok(_), None) => "?".into(),
            };
            match &r.definition {
                Ok(d) => vec![
                    r.name.clone(),
                    d.vgpu_type.clone().unwrap_or_else(|| "-".into()),
                    (if d.auto { "yes" } else { "no" }).into(),
                    state,
                    d.socket.display().to_string(),
                    if d.server_args.is_empty() {
                        "-".into()
                    } else {
                        d.server_args.join(" ")
                    },
                    params_summary(&d.params),
                ],
                Err(why) => vec![
                    r.name.clone(),
                    "-".into(),
                    "-".into(),
                    state,
                    "-".into(),
                    "-".into(),
                    why.clone(),
                ],
            }
        })
        .collect();
    use Align::Left;
    table(
        &[
            ("vGPU", Left),
            ("type", Left),
            ("auto", Left),
            ("state", Left),
            ("socket", Left),
            ("device options", Left),
            ("parameters", Left),
        ],
        &cells,
    )
}

/// A policy file as the `policy` of a `set-policy` request, checked as the daemon checks it.
fn read_policy(path: &Path) -> Result<Value, Failure> {
    let policy = read_policy_file(path).map_err(|e| Failure::Refused(e.to_string()))?;
    serde_json::to_value(policy).map_err(|e| Failure::Refused(e.to_string()))
}

/// `key=value` assignments as the `params` of a `set-params` request.
fn assignments(list: &[String]) -> Result<Map<String, Value>, Failure> {
    parse_assignments(list).map_err(|e| Failure::Refused(e.to_string()))
}

/// Checks device options as the daemon will and makes the socket path absolute.
fn device_request(socket: &Path, options: &[String]) -> Result<PathBuf, Failure> {
    ServerOptions::try_from(options.to_vec()).map_err(|e| Failure::Refused(e.to_string()))?;
    std::path::absolute(socket).map_err(|e| Failure::Refused(format!("--socket: {e}")))
}

/// Prints an answer: raw with `--json`, else through `shape`.
fn print_answer(json: bool, answer: &Value, shape: fn(&Value) -> Vec<String>) {
    if json {
        println!("{answer}");
    } else {
        for line in shape(answer) {
            println!("{line}");
        }
    }
}

fn created_lines(v: &Value) -> Vec<String> {
    let mut line = format!(
        "{} pid {} at {}",
        cell(v.get("name")),
        cell(v.get("pid")),
        cell(v.get("socket"))
    );
    if let Some(dir) = v.get("dump_dir").filter(|d| !d.is_null()) {
        line.push_str(&format!(", dumps in {}", cell(Some(dir))));
    }
    vec![line]
}

fn destroyed_lines(v: &Value) -> Vec<String> {
    vec![format!(
        "{}: {}",
        cell(v.get("name")),
        cell(v.get("status"))
    )]
}

fn run(cli: Cli) -> Result<(), Failure> {
    let store = Store::new(&cli.config_dir);
    let (request, shape): (Value, fn(&Value) -> Vec<String>) = match &cli.command {
        Cmd::List {
            defined: true,
            names,
        } => return list_defined(&cli, &store, *names),
        Cmd::List {
            defined: false,
            names: true,
        } => return list_names(&cli),
        Cmd::List {
            defined: false,
            names: false,
        } => (json!({"cmd": "list"}), list_lines),
        Cmd::Show { vm, watch, count } => {
            let count = if watch.is_some() { *count } else { Some(1) };
            return show(&cli, vm.as_deref(), *watch, count, false);
        }
        Cmd::Top {
            vm,
            interval,
            count,
        } => {
            let in_place = std::io::stdout().is_terminal();
            return show(&cli, vm.as_deref(), Some(*interval), *count, in_place);
        }
        Cmd::SetPolicy { file } => (
            json!({"cmd": "set-policy", "policy": read_policy(file)?}),
            |v| vec![format!("policy: {}", cell(v.get("policy")))],
        ),
        Cmd::Set {
            vm,
            live,
            config,
            both,
            add,
            params,
        } => {
            let scope = match (*live, *config, *both) {
                (true, _, _) => Scope::Live,
                (_, true, _) => Scope::Config,
                (_, _, true) => Scope::Both,
                _ => Scope::Current,
            };
            return set(&cli, &store, vm, scope, *add, params);
        }
        Cmd::Forget { vm } => (json!({"cmd": "forget", "vm": vm}), |v| {
            vec![format!("{}: forgotten", cell(v.get("name")))]
        }),
        Cmd::Focus { vm } => (json!({"cmd": "focus", "vm": vm}), |_| Vec::new()),
        Cmd::Create {
            name,
            socket,
            options,
        } => {
            let socket = device_request(socket, options)?;
            (
                json!({"cmd": "create", "name": name, "socket": socket, "args": options}),
                created_lines,
            )
        }
        Cmd::Destroy { name } | Cmd::Stop { name } => {
            (json!({"cmd": "destroy", "name": name}), destroyed_lines)
        }
        Cmd::Dashboard => (json!({"cmd": "dashboard"}), |v| vec![cell(v.get("url"))]),
        Cmd::Types { names } => return list_types(&cli, &store, *names),
        Cmd::Define {
            name,
            socket,
            vgpu_type,
            auto,
            params,
            options,
        } => {
            let socket = device_request(socket, options)?;
            let params = assignments(params)?.into_iter().collect();
            let def = match vgpu_type {
                Some(t) => store.define_typed(name, t, socket, *auto, params, options)?,
                None => {
                    let def = Definition {
                        socket,
                        server_args: options.clone(),
                        params,
                        auto: *auto,
                        uuid: Some(Uuid::new_v4()),
                        vgpu_type: None,
                    };
                    store.define(name, &def)?;
                    def
                }
            };
            print_definition(cli.json, &store, name, &def, "defined")?;
            return Ok(());
        }
        Cmd::Modify {
            name,
            socket,
            auto,
            no_auto,
            clear_options,
            params,
            options,
        } => {
            let mut def = store.read(name)?;
            if let Some(socket) = socket {
                def.socket = device_request(socket, &[])?;
            }
            if *auto || *no_auto {
                def.auto = *auto;
            }
            if *clear_options || !options.is_empty() {
                def.server_args.clone_from(options);
            }
            def.params.extend(assignments(params)?);
            def.uuid.get_or_insert_with(Uuid::new_v4);
            store.modify(name, &def)?;
            print_definition(cli.json, &store, name, &def, "changed")?;
            return Ok(());
        }
        Cmd::Undefine { name } => {
            store.undefine(name)?;
            if cli.json {
                println!("{}", json!({"name": name}));
            } else {
                println!("{name} undefined");
            }
            return Ok(());
        }
        Cmd::Start { name } => return start(&cli, &store, name),
    };
    let mut conn = Conn::open(&cli.control)?;
    let answer = conn.call(&request)?;
    print_answer(cli.json, &answer, shape);
    Ok(())
}

/// `start NAME`: the definition's parameters first (the daemon keeps them for a VM that has
/// not connected yet, so they are in force from its first group), then its device process.
fn start(cli: &Cli, store: &Store, name: &str) -> Result<(), Failure> {
    let def = store.read(name)?;
    let mut conn = Conn::open(&cli.control)?;
    if !def.params.is_empty() {
        // The definition names the VM, whether or not the daemon reads this config dir.
        conn.call(&json!({"cmd": "set-params", "vm": name, "params": def.params, "add": true}))?;
    }
    let answer = conn.call(&json!({
        "cmd": "create",
        "name": name,
        "socket": def.socket,
        "args": def.server_args,
    }))?;
    print_answer(cli.json, &answer, created_lines);
    Ok(())
}

/// What `set` changes, as virsh's `--live`, `--config` and `--current`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// The running VM's parameters (the daemon's).
    Live,
    /// The VM's definition.
    Config,
    /// Both.
    Both,
    /// The running VM if it runs, else its definition if it has one, else the daemon's.
    Current,
}

/// `set VM KEY=VALUE...` in `scope`. Everything is checked before anything changes: the
/// assignments, the changed definition (as `define` checks it) and then the daemon's own
/// check of the live change.
fn set(
    cli: &Cli,
    store: &Store,
    vm: &str,
    scope: Scope,
    add: bool,
    list: &[String],
) -> Result<(), Failure> {
    let params = assignments(list)?;
    let scope = match scope {
        Scope::Current => current_scope(cli, store, vm)?,
        s => s,
    };
    let defined = match scope {
        Scope::Config | Scope::Both => {
            let mut def = store.read(vm)?;
            def.params
                .extend(params.iter().map(|(k, v)| (k.clone(), v.clone())));
            def.check()
                .map_err(|why| Failure::Refused(format!("{vm}: {why}")))?;
            Some(def)
        }
        Scope::Live | Scope::Current => None,
    };
    if scope != Scope::Config {
        let mut conn = Conn::open(&cli.control)?;
        let answer = conn.call(&json!({
            "cmd": "set-params", "vm": vm, "params": params, "add": add,
        }))?;
        print_answer(cli.json, &answer, |v| {
            vec![format!(
                "{} (live): {}",
                cell(v.get("name")),
                set_params_summary(Some(v))
            )]
        });
    }
    if let Some(def) = defined {
        store.modify(vm, &def)?;
        if cli.json {
            print_definition(true, store, vm, &def, "changed")?;
        } else {
            let params = serde_json::to_value(&def.params).unwrap_or_default();
            println!("{vm} (config): {}", set_params_summary(Some(&params)));
        }
    }
    Ok(())
}

/// The scope of a `set` without `--live`, `--config` or `--both`: live when the daemon runs
/// the VM (connected, or with a device process), config when it is defined, live otherwise
/// (the daemon then refuses a VM it does not know). With no daemon to ask, nothing runs: a
/// defined VM's definition is changed.
fn current_scope(cli: &Cli, store: &Store, vm: &str) -> Result<Scope, Failure> {
    let listed = match Conn::open(&cli.control).and_then(|mut c| c.call(&json!({"cmd": "list"}))) {
        Ok(listed) => listed,
        Err(Failure::Connection(_)) if store.is_defined(vm) => return Ok(Scope::Config),
        Err(e) => return Err(e),
    };
    let named = |key: &str| {
        listed
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|v| v.get("name").and_then(Value::as_str) == Some(vm))
            .cloned()
            .collect::<Vec<Value>>()
    };
    let connected = named("vms")
        .iter()
        .any(|v| v.get("connected").and_then(Value::as_bool) == Some(true));
    let running = connected || !named("children").is_empty();
    Ok(if !running && store.is_defined(vm) {
        Scope::Config
    } else {
        Scope::Live
    })
}

/// The parameters of a `set` answer as `set` takes them (`priority=3 weight=256 ...`), the
/// name and unset ones left out.
fn set_params_summary(params: Option<&Value>) -> String {
    let map: std::collections::BTreeMap<String, Value> = params
        .and_then(Value::as_object)
        .into_iter()
        .flatten()
        .filter(|(k, v)| *k != "name" && !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    params_summary(&map)
}

/// Prints a definition just written (`defined` or `changed`).
fn print_definition(
    json: bool,
    store: &Store,
    name: &str,
    def: &Definition,
    what: &str,
) -> Result<(), Failure> {
    let path = store.path(name)?;
    if json {
        println!("{}", json!({"name": name, "path": path, "definition": def}));
    } else {
        let auto = if def.auto { " (started at boot)" } else { "" };
        println!("{name} {what} in {}{auto}", path.display());
        if let Some(t) = &def.vgpu_type {
            println!("  type: {t}");
        }
        if let Some(u) = def.uuid {
            println!("  uuid: {u}");
        }
    }
    Ok(())
}

/// The lines of `vgpuctl types`.
fn type_lines(types: &[ListedType]) -> Vec<String> {
    let cells: Vec<Vec<String>> = types
        .iter()
        .map(|(name, t)| match t {
            Ok((t, defined)) => {
                let memory = ServerOptions::try_from(t.server_args.clone())
                    .ok()
                    .and_then(|o| o.memory_mb)
                    .map_or_else(|| "default".into(), |mb| format!("{mb} MiB"));
                vec![
                    name.clone(),
                    t.max_instances.to_string(),
                    t.max_instances.saturating_sub(*defined).to_string(),
                    memory,
                    params_summary(&t.params),
                    t.description.clone(),
                ]
            }
            Err(e) => vec![
                name.clone(),
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                format!("broken: {e}"),
            ],
        })
        .collect();
    use Align::{Left, Right};
    table(
        &[
            ("type", Left),
            ("max", Right),
            ("free", Right),
            ("memory", Left),
            ("parameters", Left),
            ("description", Left),
        ],
        &cells,
    )
}

/// `types`: every vGPU type with its free instances (no daemon needed); with `names` only the
/// names of those that are not broken.
fn list_types(cli: &Cli, store: &Store, names: bool) -> Result<(), Failure> {
    let types = store.types()?;
    if names {
        let usable = types
            .iter()
            .filter(|(_, t)| t.is_ok())
            .map(|(n, _)| n.clone());
        return print_names(cli.json, usable);
    }
    if cli.json {
        let entries: Vec<Value> = types
            .iter()
            .map(|(name, t)| match t {
                Ok((t, defined)) => json!({
                    "name": name,
                    "type": t,
                    "defined": defined,
                    "free": t.max_instances.saturating_sub(*defined),
                }),
                Err(e) => json!({"name": name, "error": e.to_string()}),
            })
            .collect();
        println!("{}", Value::Array(entries));
    } else {
        for line in type_lines(&types) {
            println!("{line}");
        }
    }
    Ok(())
}

/// Prints `names`, sorted, each once (`--names`): one per line, or with `json` one array.
fn print_names(json: bool, names: impl Iterator<Item = String>) -> Result<(), Failure> {
    let names: std::collections::BTreeSet<String> = names.collect();
    let mut out = String::new();
    if json {
        out = json!(names).to_string();
        out.push('\n');
    } else {
        for name in names {
            out.push_str(&name);
            out.push('\n');
        }
    }
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| Failure::Connection(format!("stdout: {e}")))
}

/// `list --names`: the VMs the daemon knows (connected, or with parameters it keeps) and the
/// names of its device processes.
fn list_names(cli: &Cli) -> Result<(), Failure> {
    let listed = Conn::open(&cli.control)?.call(&json!({"cmd": "list"}))?;
    let names = ["vms", "children"]
        .into_iter()
        .filter_map(|key| listed.get(key).and_then(Value::as_array))
        .flatten()
        .filter_map(|v| v.get("name").and_then(Value::as_str))
        .map(str::to_owned);
    print_names(cli.json, names)
}

/// `list --defined`: every definition and whether the daemon runs its device process. The
/// definitions are listed even when the daemon cannot be asked (state `?`). With `names`, only
/// their names, without asking the daemon.
fn list_defined(cli: &Cli, store: &Store, names: bool) -> Result<(), Failure> {
    let listed = store.list()?;
    if names {
        return print_names(cli.json, listed.into_iter().map(|(name, _)| name));
    }
    let running = Conn::open(&cli.control).and_then(|mut c| c.call(&json!({"cmd": "list"})));
    let children = match &running {
        Ok(v) => v.get("children").and_then(Value::as_array).cloned(),
        Err(Failure::Connection(e) | Failure::Refused(e)) => {
            eprintln!("vgpuctl: cannot tell what runs: {e}");
            None
        }
    };
    let pid_of = |name: &str| {
        children
            .iter()
            .flatten()
            .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
            .and_then(|c| c.get("pid"))
            .and_then(Value::as_u64)
    };
    let rows: Vec<DefinedRow> = listed
        .into_iter()
        .map(|(name, def)| DefinedRow {
            pid: pid_of(&name),
            definition: def.map_err(|e| e.to_string()),
            name,
        })
        .collect();
    if cli.json {
        let entries: Vec<Value> = rows
            .iter()
            .map(|r| match &r.definition {
                Ok(d) => json!({"name": r.name, "definition": d, "pid": r.pid}),
                Err(e) => json!({"name": r.name, "error": e, "pid": r.pid}),
            })
            .collect();
        println!("{}", Value::Array(entries));
    } else {
        for line in defined_lines(&rows, children.is_some()) {
            println!("{line}");
        }
    }
    Ok(())
}

/// `show` and `top`: statistics (of the VM `only`, else of all) every `every` (once
/// without), `count` times (forever without), redrawn in place when `in_place`.
fn show(
    cli: &Cli,
    only: Option<&str>,
    every: Option<Duration>,
    count: Option<u64>,
    in_place: bool,
) -> Result<(), Failure> {
    let mut conn = Conn::open(&cli.control)?;
    let mut shown = 0u64;
    loop {
        let mut answer = conn.call(&json!({"cmd": "stats"}))?;
        if let Some(vms) = answer.get_mut("vms") {
            let all = vms.as_array().map(Vec::as_slice).unwrap_or_default();
            *vms = Value::Array(only_vm(all, only)?);
        }
        let mut out = String::new();
        if cli.json {
            out.push_str(&answer.to_string());
            out.push('\n');
        } else {
            if in_place {
                out.push_str(CLEAR_SCREEN);
            } else if shown > 0 {
                out.push('\n');
            }
            for line in stats_lines(&answer) {
                out.push_str(&line);
                out.push('\n');
            }
            if let (true, Some(every)) = (in_place, every) {
                out.push_str(&format!(
                    "\nevery {:.1} s; Ctrl-C stops\n",
                    every.as_secs_f64()
                ));
            }
        }
        let mut stdout = std::io::stdout().lock();
        stdout
            .write_all(out.as_bytes())
            .and_then(|()| stdout.flush())
            .map_err(|e| Failure::Connection(format!("stdout: {e}")))?;
        drop(stdout);
        shown = shown.saturating_add(1);
        if count.is_some_and(|c| shown >= c) {
            return Ok(());
        }
        if let Some(w) = every {
            std::thread::sleep(w);
        }
    }
}

/// The VMs the daemon knows (`list --names`).
const LIVE_VMS: &[&str] = &["list", "--names"];
/// The persistent definitions (`list --defined --names`).
const DEFINED_VMS: &[&str] = &["list", "--defined", "--names"];
/// The vGPU types a definition can use (`types --names`).
const TYPES: &[&str] = &["types", "--names"];

/// The arguments the shell completions complete with names vgpuctl prints when asked: a VM
/// the daemon knows where the daemon acts on one, a definition where the config directory's
/// are changed, both for `set`, a type for `define --type`.
const COMPLETED: &[vgpu_cli::Values] = &[
    completed("show", "vm", &[LIVE_VMS]),
    completed("top", "vm", &[LIVE_VMS]),
    completed("set", "vm", &[LIVE_VMS, DEFINED_VMS]),
    completed("forget", "vm", &[LIVE_VMS]),
    completed("focus", "vm", &[LIVE_VMS]),
    completed("destroy", "name", &[LIVE_VMS]),
    completed("stop", "name", &[LIVE_VMS]),
    completed("start", "name", &[DEFINED_VMS]),
    completed("modify", "name", &[DEFINED_VMS]),
    completed("undefine", "name", &[DEFINED_VMS]),
    completed("define", "vgpu_type", &[TYPES]),
];

const fn completed(
    subcommand: &'static str,
    arg: &'static str,
    queries: &'static [&'static [&'static str]],
) -> vgpu_cli::Values {
    vgpu_cli::Values {
        subcommand,
        arg,
        queries,
    }
}

fn main() -> ExitCode {
    let cli: Cli = vgpu_cli::parse_with(COMPLETED);
    let json = cli.json;
    vgpu_schedd::client::exit("vgpuctl", json, run(cli))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_schedd::client::signed_ms;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        vgpu_cli::check::arguments(args)
    }

    #[test]
    fn command_line_conventions() {
        vgpu_cli::check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
        vgpu_cli::check::operator_man_page::<Cli>().unwrap();
        vgpu_cli::check::completion_values::<Cli>(COMPLETED).unwrap();
    }

    #[test]
    fn the_old_command_lines_still_parse() {
        let cli = parse(&["--control", "/tmp/c", "--json", "show"]).unwrap();
        assert_eq!(cli.control, Path::new("/tmp/c"));
        assert!(cli.json);
        assert!(matches!(
            cli.command,
            Cmd::Show {
                vm: None,
                watch: None,
                count: None
            }
        ));
        let cli = parse(&["show", "--watch", "5", "--count", "3", "--control=/x"]).unwrap();
        assert_eq!(cli.control, Path::new("/x"));
        assert!(matches!(
            cli.command,
            Cmd::Show { vm: None, watch: Some(w), count: Some(3) } if w == Duration::from_secs(5)
        ));
        let cli = parse(&["show", "vm1"]).unwrap();
        assert!(matches!(cli.command, Cmd::Show { vm: Some(ref v), .. } if v == "vm1"));
        let cli = parse(&["top", "vm1", "--count", "1"]).unwrap();
        assert!(matches!(cli.command, Cmd::Top { vm: Some(ref v), .. } if v == "vm1"));
        let cli = parse(&["create", "vm1", "--socket", "/run/a.sock"]).unwrap();
        assert!(
            matches!(cli.command, Cmd::Create { ref name, ref options, .. } if name == "vm1" && options.is_empty())
        );
        let cli = parse(&[
            "create",
            "vm1",
            "--socket=/run/a",
            "--",
            "--display",
            "640x480",
        ])
        .unwrap();
        assert!(
            matches!(cli.command, Cmd::Create { ref options, .. } if options == &["--display", "640x480"])
        );
        let cli = parse(&["set", "a", "priority=3", "weight=5"]).unwrap();
        assert!(matches!(cli.command, Cmd::Set { ref params, .. } if params.len() == 2));
        assert_eq!(parse(&["list"]).unwrap().config_dir, Path::new("/etc/vgpu"));
    }

    #[test]
    fn definitions_parse() {
        let cli = parse(&[
            "--config-dir=/tmp/cfg",
            "define",
            "vm1",
            "--socket",
            "/run/vm1.sock",
            "priority=3",
            "--auto",
            "--",
            "--renderer",
            "none",
        ])
        .unwrap();
        assert_eq!(cli.config_dir, Path::new("/tmp/cfg"));
        let Cmd::Define {
            name,
            auto,
            params,
            options,
            ..
        } = cli.command
        else {
            panic!()
        };
        assert_eq!((name.as_str(), auto), ("vm1", true));
        assert_eq!(params, ["priority=3"]);
        assert_eq!(options, ["--renderer", "none"]);
        let cli = parse(&["set", "--config", "a", "weight=2"]).unwrap();
        assert!(matches!(
            cli.command,
            Cmd::Set {
                config: true,
                live: false,
                both: false,
                add: false,
                ..
            }
        ));
        assert!(matches!(
            parse(&["list", "--defined"]).unwrap().command,
            Cmd::List {
                defined: true,
                names: false
            }
        ));
        assert!(matches!(
            parse(&["list", "--defined", "--names"]).unwrap().command,
            Cmd::List {
                defined: true,
                names: true
            }
        ));
        assert!(matches!(
            parse(&["types", "--names"]).unwrap().command,
            Cmd::Types { names: true }
        ));
        for ok in [
            &["start", "a"][..],
            &["stop", "a"],
            &["undefine", "a"],
            &["dashboard"],
            &["forget", "a"],
            &[
                "modify",
                "a",
                "--no-auto",
                "weight=3",
                "--",
                "--renderer",
                "none",
            ],
            &["modify", "a", "--socket=/run/b.sock", "--clear-options"],
            &["set", "--both", "a", "priority=1"],
            &["set", "--live", "--add", "a", "priority=1"],
        ] {
            assert!(parse(ok).is_ok(), "{ok:?}");
        }
    }

    #[test]
    fn usage_errors_are_refused() {
        for bad in [
            &[][..],
            &["show", "--count", "3"],
            &["show", "--watch", "0"],
            &["show", "--watch", "nan"],
            &["show", "--watch", "1", "--count", "0"],
            &["top", "--interval", "0.01"],
            &["set", "a"],
            &["create", "a"],
            &["define", "a"],
            &["set", "--live", "--config", "a", "priority=1"],
            &["set", "--config", "--both", "a", "priority=1"],
            &["set", "--live", "--both", "a", "priority=1"],
            &["set", "--config", "--add", "a", "priority=1"],
            &["modify", "a", "--auto", "--no-auto"],
            &["modify"],
            &["forget"],
            &["frobnicate"],
            &["--bogus", "list"],
        ] {
            let e = parse(bad).map(|_| ()).expect_err(&format!("{bad:?}"));
            assert_eq!(e.exit_code(), 2, "{bad:?}");
        }
    }

    fn stats() -> Value {
        json!({
            "now": 1, "policy": "timegraph", "engine_busy": 0.4567, "engine_switches": 3,
            "vms": [
                {"name": "game", "vgpu": 0, "connected": true, "gpu_share": 0.452,
                 "groups_per_sec": 120.0, "fps": 59.84, "queue_depth": 2, "in_flight": 1,
                 "latency_p50_us": 800, "latency_p99_us": 2400,
                 "memory_used_bytes": 314_572_800_u64, "memory_limit_bytes": 2_147_483_648_u64,
                 "budget": {"remaining_ns": 3_000_000, "capacity_ns": 5_000_000, "period_ns": 10_000_000},
                 "figures": {"priority": 3.0, "ht": 0.0, "reserved": 1.0, "admitted": 1.0,
                             "background": 0.0, "throttled": 0.0, "budget_ns": 3.0e6,
                             "capacity_ns": 5.0e6, "period_ns": 1.0e7}},
                {"name": "bomb", "vgpu": 1, "connected": true, "gpu_share": 0.05,
                 "groups_per_sec": 10.0, "fps": 0.0, "queue_depth": 12, "in_flight": 1,
                 "latency_p50_us": 150, "latency_p99_us": 900, "budget": null,
                 "figures": {"priority": 0.0, "ht": 1.0, "reserved": 0.0, "admitted": 0.0,
                             "background": 1.0, "throttled": 1.0}},
                {"name": "idle", "vgpu": null, "connected": false, "gpu_share": 0.0,
                 "groups_per_sec": 0.0, "fps": 0.0, "queue_depth": 0, "in_flight": 0,
                 "latency_p50_us": 0, "latency_p99_us": 0, "budget": null, "figures": {}}
            ]
        })
    }

    #[test]
    fn show_is_a_table_with_units_and_one_policy_column() {
        let lines = stats_lines(&stats());
        let expected = [
            "policy: timegraph  engine busy: 45.7 %  VMs: 3",
            "VM    vGPU  state      GPU share  frame rate   groups  queue  in flight  latency p50/p99        memory  policy",
            "game     0  connected     45.2 %    59.8 fps  120.0/s      2          1       0.8/2.4 ms  300/2048 MiB  reserve 3.0/5.0 ms",
            "bomb     1  connected      5.0 %     0.0 fps   10.0/s     12          1       150/900 µs             -  prio 0 ht, throttled",
            "idle     -  away               -           -        -      -          -                -             -  -",
        ];
        assert_eq!(lines, expected);
        // No raw key=value policy dumps.
        assert!(!lines.iter().any(|l| l.contains('=')));
    }

    #[test]
    fn policy_column_per_family() {
        let figs = |v: Value| v.as_object().unwrap().clone();
        let cases = [
            (
                "fair",
                json!({"vtime_ms": 10.0, "lag_ms": 0.4, "charged_ms": 3.0, "over": 0.0}),
                "vt +0.4 ms",
            ),
            (
                "fair",
                json!({"vtime_ms": 10.0, "lag_ms": 6.0, "charged_ms": 3.0, "over": 1.0}),
                "vt +6.0 ms, over",
            ),
            (
                "pegasus-xc",
                json!({"credits_x": 256.0, "credit_ns": 1.2e6, "aug_credit_ns": 0.0,
                       "slice_ticks": 3.0, "context_established": 1.0, "slo_violated": 0.0}),
                "credits +1.2 ms",
            ),
            (
                "pegasus-slaf",
                json!({"credit_ns": -2.5e6, "slo_violated": 1.0}),
                "credits -2.5 ms, SLO missed",
            ),
            (
                "vgris",
                json!({"sla_aware": 0.0, "share": 0.25, "budget_ns": 1.0e6, "fps": 30.0}),
                "share 25 % +1.0 ms",
            ),
            (
                "vgris",
                json!({"sla_aware": 1.0, "share": 0.0, "delay_ns": 2.1e6}),
                "delay 2.1 ms",
            ),
            (
                "timegraph",
                json!({"priority": 5.0, "reserved": 1.0, "admitted": 0.0}),
                "reserve refused, prio 5",
            ),
            ("timegraph", json!({"priority": 2.0}), "prio 2 prt"),
            ("none", json!({}), "-"),
            ("fair", json!({}), "-"),
        ];
        for (policy, figures, expected) in cases {
            assert_eq!(
                policy_cell(policy, &figs(figures.clone())),
                expected,
                "{policy} {figures}"
            );
        }
        assert_eq!(signed_ms(-10.0), "+0.0");
    }

    #[test]
    fn list_is_readable() {
        let v = json!({
            "policy": {"policy": "timegraph"},
            "vms": [
                {"name": "a", "connected": true, "vgpu": 0, "device_pid": 42, "qemu_pid": 7,
                 "params": {"name": "a", "priority": 3, "sched": "prt", "reserve":
                     {"c": 2_000_000, "t": 10_000_000, "enforcement": "pe", "shared": null},
                     "weight": 256, "slo": null, "target_fps": null},
                 "effective": {"name": "a", "priority": 4294967295u64, "sched": "prt", "reserve":
                     {"c": 2_000_000, "t": 10_000_000, "enforcement": "pe", "shared": null},
                     "weight": 256, "slo": null, "target_fps": null}},
                {"name": "b", "connected": false, "vgpu": null, "device_pid": null, "qemu_pid": null,
                 "params": {"name": "b", "priority": 0, "sched": null, "reserve": null,
                     "weight": 512, "slo": 250_000_000u64, "target_fps": 30.0},
                 "effective": null}
            ],
            "children": [{"name": "a", "pid": 42, "socket": "/run/a.sock"}]
        });
        let expected = [
            "policy: timegraph",
            "VM  vGPU  connected  pid  qemu  priority  weight  sched  reserve C/T µs  slo µs/s  fps target",
            "a      0  yes         42     7      max*     256  prt    2000/10000/pe          -           -",
            "b      -  no           -     -         0     512  -      -                 250000        30.0",
            POLICY_LEGEND,
            "",
            "device process  pid  socket",
            "a                42  /run/a.sock",
        ];
        assert_eq!(list_lines(&v), expected);
    }

    #[test]
    fn defined_list_says_what_runs() {
        let def = Definition {
            socket: PathBuf::from("/run/a.sock"),
            server_args: vec!["--renderer".into(), "none".into()],
            params: [("priority".to_owned(), json!(3))].into_iter().collect(),
            auto: true,
            uuid: None,
            vgpu_type: Some("small".into()),
        };
        let rows = [
            DefinedRow {
                name: "a".into(),
                definition: Ok(def.clone()),
                pid: Some(42),
            },
            DefinedRow {
                name: "b".into(),
                definition: Ok(Definition {
                    auto: false,
                    server_args: Vec::new(),
                    params: Default::default(),
                    vgpu_type: None,
                    ..def
                }),
                pid: None,
            },
            DefinedRow {
                name: "c".into(),
                definition: Err("c.json: bad".into()),
                pid: None,
            },
        ];
        let expected = [
            "vGPU  type   auto  state             socket       device options   parameters",
            "a     small  yes   running (pid 42)  /run/a.sock  --renderer none  priority=3",
            "b     -      no    stopped           /run/a.sock  -                -",
            "c     -      -     broken            -            -                c.json: bad",
        ];
        assert_eq!(defined_lines(&rows, true), expected);
        assert!(defined_lines(&rows, false)[2].contains(" ? "));
    }
}
