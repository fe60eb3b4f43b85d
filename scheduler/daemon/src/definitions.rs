//! Persistent vGPU definitions, in the style of mdevctl: one JSON file per vGPU at
//! `<config-dir>/vgpus/<NAME>.json` (config dir `/etc/vgpu` unless told), holding what a
//! `vgpuctl create` and `vgpuctl set` would say for it and whether the daemon starts it at boot.
//!
//! ```json
//! {
//!   "socket": "/run/vgpu/vm1.sock",
//!   "server_args": ["--renderer", "none"],
//!   "params": {"priority": 3, "reserve": {"c": 2000000, "t": 10000000, "enforcement": "pe"}},
//!   "auto": true
//! }
//! ```
//!
//! `vgpuctl define/modify/undefine/start/stop/list --defined` and `vgpu-schedd --config-dir`
//! all read them through [`Store`], so a definition is checked the same way wherever it is
//! used ([`Definition::check`]): the name as a file-safe VM name ([`check_name`]), the file's
//! size ([`MAX_DEFINITION_BYTES`]), no unknown fields, the socket as `create` takes it
//! ([`check_socket_path`]), the device options as `create` takes them ([`ServerOptions`]) and
//! the parameters as `set-params` takes them ([`ParamsOverride`], then the scheduler's
//! [`check_params`], as the daemon checks every change). Writing one (`define`, `modify`) also
//! checks that the socket's directory exists ([`check_socket_dir`]), as `start` will. Files are
//! written atomically (a temporary file renamed or linked into place), mode 0644 in a directory
//! made 0755. The JSON Schema is `docs/vgpu-definition.schema.json`.
//!
//! vGPU types (profiles, as `mdevctl types` and `nvidia-smi vgpu -s` list them) live beside
//! them, one file per type at `<config-dir>/types/<TYPE>.json` ([`VgpuType`]): the parameters
//! and device options every vGPU of the type gets, and how many may be defined
//! (`max_instances`). `vgpuctl define NAME --type TYPE` copies them into the new definition,
//! which records its type; the type's free instances are its maximum less the definitions of
//! that type ([`Store::define_typed`], under a lock so that two defines cannot both take the
//! last one). Every definition gets a stable identity when it is written first, a random
//! UUID, as mdevctl gives each mediated device.
//!
//! The same directory keeps the daemon's live state ([`LiveState`], `<config-dir>/live.json`):
//! the policy and the VMs' parameters as `set-policy` and `set` last changed them, so that a
//! restarted daemon schedules as the one before it did.

use std::collections::BTreeMap;
use std::fs::{DirBuilder, OpenOptions, Permissions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;
use uuid::Uuid;
use vgpu_scheduler::core::check_params;
use vgpu_scheduler::sim::ParamsOverride;
use vgpu_scheduler::{PolicyConfig, VgpuParams};

use crate::control::{ServerOptions, check_socket_dir, check_socket_path};
use crate::proto::{VmName, is_plain_name};

/// Where definitions live when no `--config-dir` is given.
pub const DEFAULT_CONFIG_DIR: &str = "/etc/vgpu";
/// The directory under the config dir that holds one file per definition.
pub const DEFINITIONS_DIR: &str = "vgpus";
/// Largest definition file read: a definition is a few hundred bytes; this bounds what a
/// stray file makes the daemon read at boot.
pub const MAX_DEFINITION_BYTES: u64 = 64 * 1024;
/// Most definitions listed (files looked at): the daemon runs at most a few hundred device
/// processes, and a directory full of junk must not stall its boot.
pub const MAX_DEFINITIONS: usize = 1024;
/// Longest definition name: it is a file name and a VM name.
pub const MAX_NAME_BYTES: usize = 64;
/// The file name suffix of a definition.
const SUFFIX: &str = ".json";
/// The directory under the config dir that holds one file per vGPU type.
pub const TYPES_DIR: &str = "types";
/// Most instances a type may allow: as many as there may be definitions.
pub const MAX_TYPE_INSTANCES: u32 = MAX_DEFINITIONS as u32;
/// Longest type description: one line of `vgpuctl types`.
pub const MAX_DESCRIPTION_BYTES: usize = 200;
/// The lock file (in the definitions' directory) that typed defines hold while they count a
/// type's instances and write the new one.
const LOCK_FILE: &str = ".lock";
/// The file under the config dir that keeps the daemon's live state ([`LiveState`]).
pub const LIVE_STATE_FILE: &str = "live.json";
/// Largest live state file read: the parameters of [`crate::daemon::MAX_STORED_VMS`] VMs at a
/// few hundred bytes each, and a policy with its spec lines.
pub const MAX_LIVE_STATE_BYTES: u64 = 4 * 1024 * 1024;

/// Why a definition could not be read, written or used.
#[derive(Debug, Error)]
pub enum DefinitionError {
    /// The name is not a file-safe VM name.
    #[error("invalid vGPU name {name:?}: {why}")]
    BadName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        why: String,
    },
    /// A file system operation failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The file is larger than its kind may be ([`MAX_DEFINITION_BYTES`] for a definition or
    /// type, [`MAX_LIVE_STATE_BYTES`] for the live state).
    #[error("{}: larger than {max} bytes", path.display())]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its kind's limit.
        max: u64,
    },
    /// The file is not a definition (bad JSON, unknown or missing fields, bad values).
    #[error("{}: {why}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// `define` of a name that is defined already.
    #[error("{0} is already defined (`vgpuctl modify` changes it)")]
    Exists(String),
    /// A name without a definition.
    #[error("{0} is not defined")]
    NotDefined(String),
    /// A type name without a type file.
    #[error("no vGPU type {0} (`vgpuctl types` lists them)")]
    NoType(String),
    /// Every instance of the type is defined already.
    #[error("vGPU type {name} has no free instance: {max} of {max} are defined")]
    NoCapacity {
        /// The type.
        name: String,
        /// Its `max_instances`.
        max: u32,
    },
    /// More than [`MAX_DEFINITIONS`] files in the directory.
    #[error("{}: more than {MAX_DEFINITIONS} entries", path.display())]
    TooMany {
        /// The directory.
        path: PathBuf,
    },
}

/// One persistent vGPU, as its file holds it. Its name is the file's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Definition {
    /// The vfio-user socket its device process serves (absolute, no `.`/`..`).
    pub socket: PathBuf,
    /// Options for the device process, as `vgpuctl create NAME --socket PATH -- OPTIONS`
    /// takes them ([`ServerOptions`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_args: Vec<String>,
    /// Scheduling parameters applied when it starts, as `set-params` takes them: `priority`,
    /// `weight`, `sched`, `target_fps`, `slo` (ns of GPU time per second), `reserve`
    /// (`{"c": ns, "t": ns, "enforcement": "pe"|"ae", "shared": name}`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, Value>,
    /// Whether `vgpu-schedd --config-dir` starts it when the daemon starts.
    #[serde(default)]
    pub auto: bool,
    /// Its identity, given when it is first written and kept by every change (a version-4
    /// UUID). Files written by hand may leave it out: the next `vgpuctl modify` gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<Uuid>,
    /// The vGPU type it was defined from (`define --type`): its parameters and options were
    /// copied from the type then, and it counts as one of the type's instances.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub vgpu_type: Option<String>,
}

impl Definition {
    /// Checks the definition as the daemon takes it at `start`: the socket path, the device
    /// options and the parameters (each as `set-params` parses it, then together as the
    /// scheduler checks a VM's parameters). Returns the options and parameters to start it with.
    pub fn check(&self) -> Result<(ServerOptions, ParamsOverride), String> {
        check_socket_path(&self.socket).map_err(|e| format!("socket: {e}"))?;
        if let Some(t) = &self.vgpu_type {
            check_name(t).map_err(|e| format!("type: {e}"))?;
        }
        check_options_and_params(&self.server_args, &self.params)
    }
}

/// Checks device options as `create` takes them and parameters as `set-params` takes them,
/// alone and together as the scheduler checks a VM's; returns both parsed.
fn check_options_and_params(
    server_args: &[String],
    params: &BTreeMap<String, Value>,
) -> Result<(ServerOptions, ParamsOverride), String> {
    let options = ServerOptions::try_from(server_args.to_vec()).map_err(|e| e.to_string())?;
    let map: serde_json::Map<String, Value> =
        params.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let params: ParamsOverride =
        serde_json::from_value(Value::Object(map)).map_err(|e| format!("params: {e}"))?;
    let mut applied = VgpuParams::default();
    params.apply(&mut applied);
    check_params(&applied).map_err(|e| format!("params: {e}"))?;
    Ok((options, params))
}

/// A vGPU type (profile): what every vGPU defined from it gets, and how many may be defined on
/// this host. `<config-dir>/types/<TYPE>.json`, written by the operator (or the package).
///
/// ```json
/// {
///   "description": "a quarter of the GPU, 2 GiB, 60 fps",
///   "params": {"weight": 256, "priority": 5, "target_fps": 60.0},
///   "server_args": ["--memory-mb", "2048"],
///   "max_instances": 4
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VgpuType {
    /// One line for people (at most [`MAX_DESCRIPTION_BYTES`], no control characters).
    #[serde(default)]
    pub description: String,
    /// Each instance's scheduling parameters, as a definition's `params`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, Value>,
    /// Each instance's device options, as a definition's `server_args` (`--memory-mb N`: its
    /// memory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub server_args: Vec<String>,
    /// How many vGPUs of the type may be defined (1 to [`MAX_TYPE_INSTANCES`]).
    pub max_instances: u32,
}

impl VgpuType {
    /// Checks the type as its instances' definitions will be checked, and its own fields.
    pub fn check(&self) -> Result<(ServerOptions, ParamsOverride), String> {
        if self.description.len() > MAX_DESCRIPTION_BYTES
            || self.description.chars().any(char::is_control)
        {
            return Err(format!(
                "description: at most {MAX_DESCRIPTION_BYTES} bytes on one line"
            ));
        }
        if !(1..=MAX_TYPE_INSTANCES).contains(&self.max_instances) {
            return Err(format!(
                "max_instances: {} is not in 1..={MAX_TYPE_INSTANCES}",
                self.max_instances
            ));
        }
        check_options_and_params(&self.server_args, &self.params)
    }
}

/// One entry of [`Store::types`]: a type's name, the type, and how many vGPUs of it are
/// defined; or why its file is not a type.
pub type ListedType = (String, Result<(VgpuType, u32), DefinitionError>);

/// Checks that `name` may name a definition: a valid VM name of at most [`MAX_NAME_BYTES`]
/// ASCII letters, digits, `_`, `-` and `.`, not starting with `.` (so it is a plain file name,
/// never hidden, never `..`).
pub fn check_name(name: &str) -> Result<(), DefinitionError> {
    let bad = |why: &str| {
        Err(DefinitionError::BadName {
            name: name.chars().take(MAX_NAME_BYTES).collect(),
            why: why.to_owned(),
        })
    };
    if !is_plain_name(name, MAX_NAME_BYTES) {
        return bad(&format!(
            "must be 1 to {MAX_NAME_BYTES} bytes of ASCII letters, digits, '_', '-' and '.', \
             not starting with '.'"
        ));
    }
    if let Err(e) = VmName::new(name) {
        return bad(&e.to_string());
    }
    Ok(())
}

/// The definitions under one config directory.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
    types: PathBuf,
}

/// One entry of [`Store::list`]: a definition's name and the definition, or why its file is
/// not one.
pub type Listed = (String, Result<Definition, DefinitionError>);

impl Store {
    /// The definitions of config directory `config_dir` (in its [`DEFINITIONS_DIR`]).
    pub fn new(config_dir: &Path) -> Store {
        Store {
            dir: config_dir.join(DEFINITIONS_DIR),
            types: config_dir.join(TYPES_DIR),
        }
    }

    /// The directory holding the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of definition `name`.
    pub fn path(&self, name: &str) -> Result<PathBuf, DefinitionError> {
        check_name(name)?;
        Ok(self.dir.join(format!("{name}{SUFFIX}")))
    }

    /// Reads and checks definition `name`.
    pub fn read(&self, name: &str) -> Result<Definition, DefinitionError> {
        let path = self.path(name)?;
        read_checked(&path, Definition::check, || {
            DefinitionError::NotDefined(name.to_owned())
        })
    }

    /// Reads and checks vGPU type `name`.
    pub fn read_type(&self, name: &str) -> Result<VgpuType, DefinitionError> {
        check_name(name)?;
        let path = self.types.join(format!("{name}{SUFFIX}"));
        read_checked(&path, VgpuType::check, || {
            DefinitionError::NoType(name.to_owned())
        })
    }

    /// Every vGPU type, by name, with how many vGPUs of it are defined; a broken type file
    /// is an `Err` entry. A missing directory lists nothing.
    pub fn types(&self) -> Result<Vec<ListedType>, DefinitionError> {
        let defined = self.list()?;
        Ok(file_names(&self.types)?
            .into_iter()
            .map(|name| {
                let listed = self.read_type(&name).map(|t| {
                    let n = instances(&defined, &name);
                    (t, n)
                });
                (name, listed)
            })
            .collect())
    }

    /// Defines `name` as an instance of type `type_name`: the type's parameters with `params`
    /// over them, its device options followed by `options`, a new UUID. Refused when the
    /// type's instances are all defined; the count and the write happen under the store's
    /// lock, so concurrent defines cannot take more than there are. Returns the definition.
    pub fn define_typed(
        &self,
        name: &str,
        type_name: &str,
        socket: PathBuf,
        auto: bool,
        params: BTreeMap<String, Value>,
        options: &[String],
    ) -> Result<Definition, DefinitionError> {
        let t = self.read_type(type_name)?;
        self.make_dir()?;
        let lock_path = self.dir.join(LOCK_FILE);
        let io_at = |source| DefinitionError::Io {
            path: lock_path.clone(),
            source,
        };
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o644)
            .open(&lock_path)
            .map_err(io_at)?;
        // Released when `lock` is dropped (closed), whatever happens below.
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| io_at(e.into()))?;
        if instances(&self.list()?, type_name) >= t.max_instances {
            return Err(DefinitionError::NoCapacity {
                name: type_name.to_owned(),
                max: t.max_instances,
            });
        }
        let mut def = Definition {
            socket,
            server_args: t.server_args,
            params: t.params,
            auto,
            uuid: Some(Uuid::new_v4()),
            vgpu_type: Some(type_name.to_owned()),
        };
        def.params.extend(params);
        def.server_args.extend_from_slice(options);
        self.define(name, &def)?;
        Ok(def)
    }

    /// Writes definition `name` atomically after checking it; refuses a name that is defined
    /// already. Makes the directory (0755) when missing; the file is 0644.
    pub fn define(&self, name: &str, def: &Definition) -> Result<(), DefinitionError> {
        let path = self.checked_path(name, def)?;
        self.make_dir()?;
        write_atomic(&path, &to_text(&path, def)?, Place::New).map_err(|e| match e {
            DefinitionError::Exists(_) => DefinitionError::Exists(name.to_owned()),
            e => e,
        })
    }

    /// Replaces definition `name`, which must exist, atomically after checking the new one
    /// (`vgpuctl modify`, `set --config`).
    pub fn modify(&self, name: &str, def: &Definition) -> Result<(), DefinitionError> {
        let path = self.checked_path(name, def)?;
        if !path.is_file() {
            return Err(DefinitionError::NotDefined(name.to_owned()));
        }
        write_atomic(&path, &to_text(&path, def)?, Place::Replace)
    }

    /// The file of definition `name` once `def` passed [`Definition::check`] and its socket's
    /// directory exists.
    fn checked_path(&self, name: &str, def: &Definition) -> Result<PathBuf, DefinitionError> {
        let path = self.path(name)?;
        let invalid = |why: String| DefinitionError::Invalid {
            path: path.clone(),
            why,
        };
        def.check().map_err(invalid)?;
        check_socket_dir(&def.socket).map_err(|e| invalid(format!("socket: {e}")))?;
        Ok(path)
    }

    /// Whether `name` has a definition file (read or not).
    pub fn is_defined(&self, name: &str) -> bool {
        self.path(name).is_ok_and(|p| p.is_file())
    }

    /// The file of the daemon's live state.
    pub fn live_path(&self) -> PathBuf {
        self.dir.parent().map_or_else(
            || PathBuf::from(LIVE_STATE_FILE),
            |d| d.join(LIVE_STATE_FILE),
        )
    }

    /// Writes the daemon's live state atomically, when the config dir exists: the daemon
    /// never makes it (the package does; a daemon started without one keeps nothing).
    /// `Ok(false)` when there is no config dir.
    pub fn save_live(&self, state: &LiveState) -> Result<bool, DefinitionError> {
        let path = self.live_path();
        if !path.parent().is_some_and(Path::is_dir) {
            return Ok(false);
        }
        write_atomic(&path, &to_text(&path, state)?, Place::Replace)?;
        Ok(true)
    }

    /// The daemon's live state as last saved; `None` when there is none.
    pub fn load_live(&self) -> Result<Option<LiveState>, DefinitionError> {
        let path = self.live_path();
        let Some(text) = read_bounded(&path, MAX_LIVE_STATE_BYTES)? else {
            return Ok(None);
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| DefinitionError::Invalid {
                path,
                why: e.to_string(),
            })
    }

    /// Removes definition `name`.
    pub fn undefine(&self, name: &str) -> Result<(), DefinitionError> {
        let path = self.path(name)?;
        std::fs::remove_file(&path).map_err(|source| match source.kind() {
            io::ErrorKind::NotFound => DefinitionError::NotDefined(name.to_owned()),
            _ => DefinitionError::Io { path, source },
        })
    }

    /// Every definition, by name, each read and checked on its own: a broken file is an `Err`
    /// entry, not a failure of the whole list. A missing directory lists nothing. Hidden files
    /// (temporary files among them) and files without the `.json` suffix are not looked at.
    pub fn list(&self) -> Result<Vec<Listed>, DefinitionError> {
        Ok(file_names(&self.dir)?
            .into_iter()
            .map(|name| {
                let def = self.read(&name);
                (name, def)
            })
            .collect())
    }

    /// The definitions marked `auto`, in name order; broken files are logged and skipped.
    pub fn auto_started(&self) -> Vec<(String, Definition)> {
        let listed = match self.list() {
            Ok(l) => l,
            Err(e) => {
                log::error!("definitions: {e}");
                return Vec::new();
            }
        };
        listed
            .into_iter()
            .filter_map(|(name, def)| match def {
                Ok(def) => def.auto.then_some((name, def)),
                Err(e) => {
                    log::error!("definition {name} skipped: {e}");
                    None
                }
            })
            .collect()
    }

    fn make_dir(&self) -> Result<(), DefinitionError> {
        if self.dir.is_dir() {
            return Ok(());
        }
        DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(&self.dir)
            .and_then(|()| std::fs::set_permissions(&self.dir, Permissions::from_mode(0o755)))
            .map_err(|source| DefinitionError::Io {
                path: self.dir.clone(),
                source,
            })
    }
}

/// How many of `defined` are instances of type `name`.
fn instances(defined: &[Listed], name: &str) -> u32 {
    let n = defined
        .iter()
        .filter(|(_, d)| {
            d.as_ref()
                .is_ok_and(|d| d.vgpu_type.as_deref() == Some(name))
        })
        .count();
    // At most MAX_DEFINITIONS (1024).
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// The names (less [`SUFFIX`]) of the `.json` files in `dir`, sorted; hidden files (temporary
/// files among them) are not looked at. A missing directory has none; past
/// [`MAX_DEFINITIONS`] entries it is an error.
fn file_names(dir: &Path) -> Result<Vec<String>, DefinitionError> {
    let io_err = |source| DefinitionError::Io {
        path: dir.to_owned(),
        source,
    };
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(e)),
    };
    let mut names = Vec::new();
    for (i, entry) in entries.enumerate() {
        if i >= MAX_DEFINITIONS {
            return Err(DefinitionError::TooMany {
                path: dir.to_owned(),
            });
        }
        let file = entry.map_err(io_err)?.file_name();
        let Some(name) = file.to_str().and_then(|f| f.strip_suffix(SUFFIX)) else {
            continue;
        };
        if !name.starts_with('.') {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// The text of the file at `path`, at most `max` bytes (past it [`DefinitionError::TooLarge`]);
/// `None` when there is no file.
fn read_bounded(path: &Path, max: u64) -> Result<Option<String>, DefinitionError> {
    let io_err = |source| DefinitionError::Io {
        path: path.to_owned(),
        source,
    };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(e)),
    };
    let mut text = String::new();
    // One byte more than allowed tells an oversized file from one of the largest size.
    file.take(max.saturating_add(1))
        .read_to_string(&mut text)
        .map_err(io_err)?;
    if u64::try_from(text.len()).unwrap_or(u64::MAX) > max {
        return Err(DefinitionError::TooLarge {
            path: path.to_owned(),
            max,
        });
    }
    Ok(Some(text))
}

/// Reads the JSON file at `path` (at most [`MAX_DEFINITION_BYTES`]) and checks it with
/// `check`; a missing file is `missing()`.
fn read_checked<T: DeserializeOwned, C>(
    path: &Path,
    check: impl FnOnce(&T) -> Result<C, String>,
    missing: impl FnOnce() -> DefinitionError,
) -> Result<T, DefinitionError> {
    let text = read_bounded(path, MAX_DEFINITION_BYTES)?.ok_or_else(missing)?;
    let invalid = |why: String| DefinitionError::Invalid {
        path: path.to_owned(),
        why,
    };
    let value: T = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
    check(&value).map_err(invalid)?;
    Ok(value)
}

/// What the daemon keeps across its restarts (`<config-dir>/live.json`): the policy in force
/// and the parameters of every VM the control interface set (or restored), by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LiveState {
    /// The policy, as `set-policy` installed it (or the daemon started with).
    pub policy: PolicyConfig,
    /// Each VM's parameters as `set` left them.
    #[serde(default)]
    pub params: BTreeMap<String, VgpuParams>,
}

/// Whether [`write_atomic`] may replace an existing file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Only where no file is (a hard link of the temporary file: never replaces).
    New,
    /// Over whatever is there (a rename of the temporary file).
    Replace,
}

/// `value` as the pretty JSON text of a file, with a final newline.
fn to_text<T: Serialize>(path: &Path, value: &T) -> Result<Vec<u8>, DefinitionError> {
    let mut text = serde_json::to_vec_pretty(value).map_err(|e| DefinitionError::Invalid {
        path: path.to_owned(),
        why: e.to_string(),
    })?;
    text.push(b'\n');
    Ok(text)
}

/// Writes `text` to `path` atomically: into a temporary file beside it (mode 0644, synced),
/// then linked or renamed into place, so a reader sees the old file or the new one, never part
/// of one. [`Place::New`] fails with [`DefinitionError::Exists`] where a file is.
fn write_atomic(path: &Path, text: &[u8], place: Place) -> Result<(), DefinitionError> {
    let io_at = |p: &Path| {
        let p = p.to_owned();
        move |source| DefinitionError::Io { path: p, source }
    };
    let (Some(dir), Some(file)) = (path.parent(), path.file_name()) else {
        return Err(io_at(path)(io::ErrorKind::InvalidInput.into()));
    };
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    // A leftover of a crashed writer with this pid is ours to replace.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(io_at(&tmp)(e)),
        _ => {}
    }
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&tmp)?;
        // The umask may have narrowed the mode; definitions are world-readable config.
        f.set_permissions(Permissions::from_mode(0o644))?;
        f.write_all(text)?;
        f.sync_all()
    })();
    let placed = written.map_err(io_at(&tmp)).and_then(|()| match place {
        // A hard link fails where the name exists: nothing is replaced.
        Place::New => std::fs::hard_link(&tmp, path).map_err(|e| match e.kind() {
            io::ErrorKind::AlreadyExists => {
                DefinitionError::Exists(file.to_string_lossy().into_owned())
            }
            _ => io_at(path)(e),
        }),
        Place::Replace => std::fs::rename(&tmp, path).map_err(io_at(path)),
    });
    // After a rename the temporary name is gone already.
    if let Err(e) = std::fs::remove_file(&tmp)
        && e.kind() != io::ErrorKind::NotFound
    {
        log::warn!("removing {}: {e}", tmp.display());
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::os::unix::fs::MetadataExt;

    fn def(auto: bool) -> Definition {
        Definition {
            // A directory that exists, as writing a definition requires.
            socket: std::env::temp_dir().join("a.sock"),
            server_args: vec!["--renderer".into(), "none".into()],
            params: BTreeMap::from([
                ("priority".to_owned(), json!(3)),
                (
                    "reserve".to_owned(),
                    json!({"c": 2_000_000, "t": 10_000_000, "enforcement": "pe"}),
                ),
            ]),
            auto,
            uuid: None,
            vgpu_type: None,
        }
    }

    /// Writes type `name` into `store`'s config dir.
    fn write_type(store: &Store, name: &str, t: &Value) {
        std::fs::create_dir_all(&store.types).unwrap();
        std::fs::write(store.types.join(format!("{name}.json")), t.to_string()).unwrap();
    }

    #[test]
    fn a_type_gives_its_instances_its_values_up_to_its_maximum() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path());
        let small = json!({
            "description": "a quarter, 2 GiB",
            "params": {"weight": 256, "priority": 5},
            "server_args": ["--memory-mb", "2048"],
            "max_instances": 2
        });
        write_type(&store, "small", &small);
        let socket = std::env::temp_dir().join("a.sock");
        let define = |name: &str, params: &[(&str, Value)], options: &[&str]| {
            store.define_typed(
                name,
                "small",
                socket.clone(),
                false,
                params
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.clone()))
                    .collect(),
                &options.iter().map(|o| (*o).to_owned()).collect::<Vec<_>>(),
            )
        };
        let a = define("a", &[("priority", json!(7))], &["--renderer", "none"]).unwrap();
        assert_eq!(a.vgpu_type.as_deref(), Some("small"));
        assert_eq!(a.params["weight"], json!(256));
        assert_eq!(
            a.params["priority"],
            json!(7),
            "the define's value over the type's"
        );
        assert_eq!(a.server_args, ["--memory-mb", "2048", "--renderer", "none"]);
        assert_eq!(a.check().unwrap().0.memory_mb, Some(2048));
        assert_eq!(store.read("a").unwrap(), a, "written as returned");
        // An option the type sets is not given twice.
        let e = define("x", &[], &["--memory-mb", "1"]).unwrap_err();
        assert!(e.to_string().contains("given twice"), "{e}");
        let b = define("b", &[], &[]).unwrap();
        assert_ne!(a.uuid, b.uuid, "each vGPU its own identity");
        assert!(a.uuid.is_some_and(|u| u.get_version_num() == 4));
        let e = define("c", &[], &[]).unwrap_err();
        assert!(
            matches!(e, DefinitionError::NoCapacity { max: 2, .. }),
            "{e}"
        );
        assert!(!store.is_defined("c"));
        let listed = store.types().unwrap();
        assert_eq!(listed.len(), 1);
        let (name, Ok((t, defined))) = &listed[0] else {
            panic!("{listed:?}")
        };
        assert_eq!((name.as_str(), t.max_instances, *defined), ("small", 2, 2));
        // Undefining one frees an instance.
        store.undefine("a").unwrap();
        define("c", &[], &[]).unwrap();
        assert!(matches!(
            store.define_typed("d", "large", socket.clone(), false, BTreeMap::new(), &[]),
            Err(DefinitionError::NoType(_))
        ));
    }

    #[test]
    fn the_packaged_examples_check() {
        let def: Definition =
            serde_json::from_str(include_str!("../../../packaging/config/vm1.json")).unwrap();
        def.check().unwrap();
        let t: VgpuType =
            serde_json::from_str(include_str!("../../../packaging/config/type-quarter.json"))
                .unwrap();
        assert_eq!(t.check().unwrap().0.memory_mb, Some(2048));
    }

    #[test]
    fn types_are_checked_as_their_instances_would_be() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path());
        let bad = [
            ("zero", json!({"max_instances": 0}), "max_instances"),
            ("many", json!({"max_instances": 1025}), "max_instances"),
            ("nomax", json!({}), "max_instances"),
            (
                "param",
                json!({"params": {"weight": 0}, "max_instances": 1}),
                "weight",
            ),
            (
                "option",
                json!({"server_args": ["--memory-mb", "0"], "max_instances": 1}),
                "--memory-mb",
            ),
            (
                "field",
                json!({"colour": "red", "max_instances": 1}),
                "unknown field",
            ),
            (
                "text",
                json!({"description": "two\nlines", "max_instances": 1}),
                "description",
            ),
        ];
        for (name, t, why) in &bad {
            write_type(&store, name, t);
            let e = store.read_type(name).unwrap_err().to_string();
            assert!(e.contains(why), "{name}: {e}");
        }
        write_type(&store, "ok", &json!({"max_instances": 3}));
        let listed = store.types().unwrap();
        assert_eq!(listed.len(), bad.len() + 1);
        let ok: Vec<&str> = listed
            .iter()
            .filter(|(_, t)| t.is_ok())
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(ok, ["ok"]);
        assert!(matches!(
            store.read_type("../vgpus/x"),
            Err(DefinitionError::BadName { .. })
        ));
    }

    #[test]
    fn names_are_file_safe_vm_names() {
        for good in [
            "vm1",
            "a",
            "web-01.prod",
            "A_b",
            &"x".repeat(MAX_NAME_BYTES),
        ] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "a/b",
            "a b",
            "vm:1",
            "é",
            "a\n",
            &"x".repeat(MAX_NAME_BYTES + 1),
        ] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn define_read_list_undefine() {
        let tmp = tempfile::tempdir().unwrap();
        let config = tmp.path().join("etc");
        let store = Store::new(&config);
        assert!(
            store.list().unwrap().is_empty(),
            "a missing dir lists nothing"
        );
        store.define("b", &def(true)).unwrap();
        store.define("a", &def(false)).unwrap();
        assert!(matches!(
            store.define("a", &def(true)),
            Err(DefinitionError::Exists(_))
        ));
        assert_eq!(store.read("b").unwrap(), def(true));
        let dir_mode = std::fs::metadata(store.dir()).unwrap().mode() & 0o777;
        let file_mode = std::fs::metadata(store.path("a").unwrap()).unwrap().mode() & 0o777;
        assert_eq!((dir_mode, file_mode), (0o755, 0o644));
        let names: Vec<String> = store.list().unwrap().into_iter().map(|l| l.0).collect();
        assert_eq!(names, ["a", "b"]);
        let auto: Vec<String> = store.auto_started().into_iter().map(|l| l.0).collect();
        assert_eq!(auto, ["b"]);
        // Nothing but the two files: the temporary files are gone.
        assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 2);
        store.undefine("a").unwrap();
        assert!(matches!(
            store.undefine("a"),
            Err(DefinitionError::NotDefined(_))
        ));
        assert!(matches!(
            store.read("a"),
            Err(DefinitionError::NotDefined(_))
        ));
        assert!(matches!(
            store.read("../x"),
            Err(DefinitionError::BadName { .. })
        ));
    }

    #[test]
    fn broken_files_are_listed_as_errors_and_skipped_at_boot() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path());
        store.define("good", &def(true)).unwrap();
        let write = |name: &str, text: &[u8]| std::fs::write(store.dir().join(name), text).unwrap();
        write("junk.json", b"{not json");
        write("extra.json", br#"{"socket":"/run/x","colour":"red"}"#);
        write("nosocket.json", br#"{"auto":true}"#);
        write("relsock.json", br#"{"socket":"x.sock","auto":true}"#);
        write(
            "badopt.json",
            br#"{"socket":"/run/x","server_args":["--virgl-library","/tmp/evil.so"],"auto":true}"#,
        );
        write(
            "badparam.json",
            br#"{"socket":"/run/x","params":{"colour":1},"auto":true}"#,
        );
        write(
            "badtype.json",
            br#"{"socket":"/run/x","params":{"priority":-1},"auto":true}"#,
        );
        let mut big = br#"{"socket":"/run/x","auto":true}"#.to_vec();
        big.resize(usize::try_from(MAX_DEFINITION_BYTES).unwrap() + 1, b' ');
        write("big.json", &big);
        write("bad name.json", br#"{"socket":"/run/x","auto":true}"#);
        write(".hidden.json", b"{}");
        write("notes.txt", b"hello");
        let listed = store.list().unwrap();
        let ok: Vec<&str> = listed
            .iter()
            .filter(|(_, d)| d.is_ok())
            .map(|(n, _)| n.as_str())
            .collect();
        assert_eq!(ok, ["good"]);
        assert_eq!(listed.len(), 10, "{listed:?}");
        assert!(
            listed
                .iter()
                .any(|(n, d)| n == "big" && matches!(d, Err(DefinitionError::TooLarge { .. })))
        );
        let auto: Vec<String> = store.auto_started().into_iter().map(|l| l.0).collect();
        assert_eq!(auto, ["good"]);
    }

    /// The schema documented for operators.
    const SCHEMA: &str = include_str!("../../../docs/vgpu-definition.schema.json");

    /// The `properties` of the schema object at `path` (property names, descending).
    fn schema_properties<'a>(
        schema: &'a Value,
        path: &[&str],
    ) -> &'a serde_json::Map<String, Value> {
        let mut node = schema;
        for key in path {
            node = &node["properties"][key];
        }
        assert_eq!(
            node["additionalProperties"],
            json!(false),
            "{path:?} must refuse unknown fields as the reader does"
        );
        node["properties"].as_object().expect("properties")
    }

    #[test]
    fn the_schema_documents_every_field() {
        let schema: Value = serde_json::from_str(SCHEMA).expect("the schema is JSON");
        // Every field a definition serialises, with every parameter set.
        let mut full = def(true);
        full.uuid = Some(Uuid::new_v4());
        full.vgpu_type = Some("small".into());
        full.params.extend([
            ("weight".to_owned(), json!(512)),
            ("sched".to_owned(), json!("ht")),
            ("slo".to_owned(), json!(250_000_000)),
            ("target_fps".to_owned(), json!(30.0)),
        ]);
        full.check().expect("a full definition is valid");
        let value = serde_json::to_value(&full).unwrap();
        let top = schema_properties(&schema, &[]);
        for key in value.as_object().unwrap().keys() {
            assert!(top.contains_key(key), "{key} is not in the schema");
        }
        // Every parameter the daemon keeps for a VM (its name aside) and every reserve field.
        let params = schema_properties(&schema, &["params"]);
        let vgpu = serde_json::to_value(vgpu_scheduler::model::VgpuParams::default()).unwrap();
        for key in vgpu.as_object().unwrap().keys().filter(|k| *k != "name") {
            assert!(
                params.contains_key(key),
                "params.{key} is not in the schema"
            );
            assert!(
                full.params.contains_key(key),
                "the full definition lacks {key}"
            );
        }
        let reserve = vgpu_scheduler::model::Reserve {
            c: 1,
            t: 2,
            enforcement: vgpu_scheduler::model::Enforcement::Ae,
            shared: Some("s".into()),
        };
        let in_schema = schema_properties(&schema, &["params", "reserve"]);
        for key in serde_json::to_value(reserve)
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
        {
            assert!(
                in_schema.contains_key(key),
                "reserve.{key} is not in the schema"
            );
        }
        // And nothing more: every field the schema names is one a definition takes.
        for key in params.keys() {
            assert!(vgpu.get(key).is_some(), "params.{key} is not a parameter");
        }
        for key in top.keys() {
            assert!(value.get(key).is_some(), "{key} is not a definition field");
        }
        // Its examples are valid definitions.
        for example in schema["examples"].as_array().expect("examples") {
            let d: Definition = serde_json::from_value(example.clone()).expect("example parses");
            d.check().expect("example checks");
        }
    }

    #[test]
    fn values_start_would_refuse_are_refused_when_written() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path());
        let with = |key: &str, value: Value| {
            let mut d = def(false);
            d.params.insert(key.to_owned(), value);
            d
        };
        let bad = [
            (
                with(
                    "reserve",
                    json!({"c": 2_000_000, "t": 1_000_000, "enforcement": "pe"}),
                ),
                "0 < C <= T",
            ),
            (with("weight", json!(0)), "weight must be at least 1"),
            (with("target_fps", json!(5000.0)), "target_fps"),
            (
                Definition {
                    server_args: vec!["--display".into(), "99999x1".into()],
                    ..def(false)
                },
                "16..=16384",
            ),
            (
                Definition {
                    socket: tmp.path().join("missing/a.sock"),
                    ..def(false)
                },
                "does not exist",
            ),
        ];
        store.define("ok", &def(false)).unwrap();
        for (d, why) in bad {
            let e = store.define("x", &d).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
            let e = store.modify("ok", &d).unwrap_err().to_string();
            assert!(e.contains(why), "{e}");
        }
        assert!(!store.is_defined("x"));
        assert_eq!(store.read("ok").unwrap(), def(false));
    }

    #[test]
    fn modify_replaces_a_definition_atomically() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::new(tmp.path());
        assert!(matches!(
            store.modify("a", &def(false)),
            Err(DefinitionError::NotDefined(_))
        ));
        store.define("a", &def(false)).unwrap();
        store.modify("a", &def(true)).unwrap();
        assert_eq!(store.read("a").unwrap(), def(true));
        // Only the file: the temporary one is renamed into place.
        assert_eq!(std::fs::read_dir(store.dir()).unwrap().count(), 1);
        let mode = std::fs::metadata(store.path("a").unwrap()).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o644);
    }

    #[test]
    fn live_state_round_trips_only_where_the_config_dir_exists() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = Store::new(&tmp.path().join("etc"));
        let state = LiveState {
            policy: PolicyConfig::Fair(Default::default()),
            params: BTreeMap::from([(
                "a".to_owned(),
                VgpuParams {
                    weight: 7,
                    ..VgpuParams::named("a")
                },
            )]),
        };
        assert!(!missing.save_live(&state).unwrap());
        assert!(missing.load_live().unwrap().is_none());
        let store = Store::new(tmp.path());
        assert!(store.save_live(&state).unwrap());
        assert_eq!(store.load_live().unwrap(), Some(state));
        assert_eq!(store.live_path(), tmp.path().join(LIVE_STATE_FILE));
        std::fs::write(store.live_path(), br#"{"policy":{"policy":"none"},"x":1}"#).unwrap();
        assert!(matches!(
            store.load_live(),
            Err(DefinitionError::Invalid { .. })
        ));
        // The live state is no definition.
        assert!(store.list().unwrap().is_empty());
    }

    #[test]
    fn check_returns_what_create_and_set_params_take() {
        let (options, params) = def(false).check().unwrap();
        assert_eq!(options.renderer, Some(crate::control::Renderer::None));
        assert_eq!(params.priority, Some(3));
        assert_eq!(params.reserve.map(|r| r.c), Some(2_000_000));
        let mut bad = def(false);
        bad.socket = PathBuf::from("/run/../etc/x");
        assert!(bad.check().is_err());
        let tmp = tempfile::tempdir().unwrap();
        assert!(matches!(
            Store::new(tmp.path()).define("x", &bad),
            Err(DefinitionError::Invalid { .. })
        ));
    }
}
