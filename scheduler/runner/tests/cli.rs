//! The `vgpu-sim` binary end to end: the smoke scenario's outputs, and bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn scenarios() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios")
}

fn vgpu_sim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vgpu-sim"))
        .args(args)
        .output()
        .expect("run vgpu-sim")
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn smoke_scenario_writes_table_json_csv_and_svg() {
    let out = tempfile::tempdir().unwrap();
    let file = scenarios().join("smoke.toml");
    let o = vgpu_sim(&[path_str(&file), "--out", path_str(out.path())]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8(o.stdout).unwrap();
    assert!(
        stdout.contains("| none-1bomb | game | frames |"),
        "{stdout}"
    );
    let json = std::fs::read_to_string(out.path().join("smoke.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(doc["scenario"], "smoke");
    let runs = doc["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 3);
    assert_eq!(runs[0]["vms"].as_array().unwrap().len(), 1);
    assert_eq!(runs[2]["vms"].as_array().unwrap().len(), 6);
    // The game alone runs faster than against a bomb without scheduling.
    let fps = |r: usize| runs[r]["vms"][0]["fps"].as_f64().unwrap();
    assert!(fps(0) > fps(1), "{} vs {}", fps(0), fps(1));
    let csv = std::fs::read_to_string(out.path().join("smoke.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 1 + 2 + 6);
    let svg = std::fs::read_to_string(out.path().join("smoke.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("bomb-5") && svg.contains("FPS"));
    // The same scenario gives the same JSON.
    let again = tempfile::tempdir().unwrap();
    let o = vgpu_sim(&[path_str(&file), "--out", path_str(again.path())]);
    assert!(o.status.success());
    assert_eq!(
        json,
        std::fs::read_to_string(again.path().join("smoke.json")).unwrap()
    );
}

#[test]
fn all_runs_every_scenario_file() {
    let out = tempfile::tempdir().unwrap();
    let o = vgpu_sim(&[
        "--all",
        path_str(&scenarios()),
        "--out",
        path_str(out.path()),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for entry in std::fs::read_dir(scenarios()).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let stem = p.file_stem().unwrap().to_str().unwrap().to_owned();
            assert!(out.path().join(format!("{stem}.json")).exists(), "{stem}");
        }
    }
}

/// Writes `text` as a scenario and runs it; returns stderr, asserting exit status 2.
fn refused(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, text).unwrap();
    let o = vgpu_sim(&[path_str(&file), "--out", path_str(dir.path())]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(err.contains("bad.toml"), "{err}");
    err
}

const HEAD: &str = "name = \"bad\"\nduration_ms = 100\n";
const VM: &str = "[[vm]]\nname = \"a\"\nworkload = { kind = \"bomb\", cost_us = 100 }\n";

#[test]
fn bad_files_are_refused_naming_file_and_field() {
    let missing = vgpu_sim(&["/nonexistent/x.toml"]);
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/x.toml"));

    let err = refused("name = \"bad\"\nduration_ms = [");
    assert!(
        err.contains("TOML") || err.contains("parse") || err.contains("invalid"),
        "{err}"
    );

    let run = "[[run]]\nlabel = \"r\"\npolicy = { policy = \"none\" }\nvms = [\"ghost\"]\n";
    let err = refused(&format!("{HEAD}{VM}{run}"));
    assert!(err.contains("vms") && err.contains("ghost"), "{err}");

    let run = "[[run]]\nlabel = \"r\"\npolicy = { policy = \"teleport\" }\n";
    let err = refused(&format!("{HEAD}{VM}{run}"));
    assert!(err.contains("teleport"), "{err}");

    let vm = "[[vm]]\nname = \"a\"\nworkload = { kind = \"bomb\", cost_us = 100, dpeth = 3 }\n";
    let run = "[[run]]\nlabel = \"r\"\npolicy = { policy = \"none\" }\n";
    let err = refused(&format!("{HEAD}{vm}{run}"));
    assert!(err.contains("dpeth"), "{err}");

    let vm = "[[vm]]\nname = \"a\"\nworkload = { kind = \"bomb\", cost_us = 0 }\n";
    let err = refused(&format!("{HEAD}{vm}{run}"));
    assert!(err.contains("vm.a.workload.cost_us"), "{err}");

    let usage = vgpu_sim(&["--bogus"]);
    assert_eq!(usage.status.code(), Some(2));
}
