//! The container packaging, checked without a Docker engine: the top-level `Dockerfile`
//! parsed into stages and instructions (multi-stage with a dependency-caching builder, a
//! non-root runtime, the config at `/etc/floodgate/gateway.toml`, `EXPOSE 8080 9901`,
//! `STOPSIGNAL SIGTERM`, a `HEALTHCHECK` running `floodgate healthcheck`, OCI labels, an
//! exec-form `ENTRYPOINT`); the config the image builds from the shipped `gateway.toml`,
//! validated by the real binary; `.dockerignore`; and the compose example's files.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::process::run;

const CONFIG_PATH: &str = "/etc/floodgate/gateway.toml";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(relative: &str) -> String {
    let path = repo().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One instruction: its keyword (upper case) and its arguments, continuation lines joined.
#[derive(Debug, Clone)]
struct Instruction {
    keyword: String,
    args: String,
}

impl Instruction {
    /// `--name=value` flags, then the remaining words.
    fn flags_and_words(&self) -> (Vec<&str>, Vec<&str>) {
        self.args.split_whitespace().partition(|w| w.starts_with("--"))
    }

    /// The exec form (`["a", "b"]`) parsed, or `None` for the shell form.
    fn exec_form(&self, after: &str) -> Option<Vec<String>> {
        let rest = self.args.trim().strip_prefix(after)?.trim();
        serde_json::from_str(rest).ok()
    }
}

struct Stage {
    from: Instruction,
    instructions: Vec<Instruction>,
}

impl Stage {
    fn base(&self) -> &str {
        self.from.flags_and_words().1[0]
    }

    fn name(&self) -> Option<&str> {
        let words = self.from.flags_and_words().1;
        match words.as_slice() {
            [_, as_, name] if as_.eq_ignore_ascii_case("as") => Some(name),
            _ => None,
        }
    }

    fn all(&self, keyword: &str) -> Vec<&Instruction> {
        self.instructions
            .iter()
            .filter(|i| i.keyword == keyword)
            .collect()
    }

    fn last(&self, keyword: &str) -> Option<&Instruction> {
        self.all(keyword).into_iter().last()
    }

    fn position(&self, predicate: impl Fn(&Instruction) -> bool) -> Option<usize> {
        self.instructions.iter().position(predicate)
    }
}

/// Instructions of a Dockerfile: comments and blank lines dropped (also inside a
/// continuation, as Docker does), `\` continuations joined.
fn instructions(text: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        match trimmed.strip_suffix('\\') {
            Some(head) => {
                current.push_str(head);
                current.push(' ');
            }
            None => {
                current.push_str(trimmed);
                let (keyword, args) = current.split_once(char::is_whitespace).unwrap_or((&current, ""));
                out.push(Instruction {
                    keyword: keyword.to_ascii_uppercase(),
                    args: args.trim().to_owned(),
                });
                current.clear();
            }
        }
    }
    assert!(current.is_empty(), "the Dockerfile ends inside a continuation");
    out
}

/// Global instructions (`ARG` before the first `FROM`) and the stages.
fn stages(text: &str) -> (Vec<Instruction>, Vec<Stage>) {
    let mut global = Vec::new();
    let mut stages: Vec<Stage> = Vec::new();
    for instruction in instructions(text) {
        if instruction.keyword == "FROM" {
            stages.push(Stage {
                from: instruction,
                instructions: Vec::new(),
            });
        } else if let Some(stage) = stages.last_mut() {
            stage.instructions.push(instruction);
        } else {
            global.push(instruction);
        }
    }
    (global, stages)
}

fn dockerfile() -> (Vec<Instruction>, Vec<Stage>) {
    stages(&read("Dockerfile"))
}

fn final_stage(stages: &[Stage]) -> &Stage {
    stages.last().expect("at least one FROM")
}

#[test]
fn it_is_multi_stage_a_rust_builder_then_a_debian_slim_runtime() {
    let (global, stages) = dockerfile();
    assert!(stages.len() >= 2, "{} FROM", stages.len());
    assert!(global.iter().all(|i| i.keyword == "ARG"), "{global:?}");

    let builder = &stages[0];
    assert!(builder.base().starts_with("rust:"), "{}", builder.base());
    assert!(builder.base().ends_with("-slim-bookworm"), "{}", builder.base());
    assert_eq!(builder.name(), Some("builder"));

    let runtime = final_stage(&stages);
    assert_eq!(runtime.base(), "debian:bookworm-slim");
    // The runtime is built from the binary alone, not from the builder image.
    assert!(stages.iter().skip(1).all(|s| !s.base().starts_with("rust:")));
    let copies = runtime.all("COPY");
    let binary = copies
        .iter()
        .find(|c| c.args.contains("/usr/local/bin/floodgate"))
        .expect("the binary is copied into the runtime");
    assert!(binary.args.contains("--from=builder"), "{binary:?}");
    assert!(binary.args.contains("target/release/floodgate"), "{binary:?}");

    // rediss:// checks certificates against the system roots.
    assert!(
        runtime
            .all("RUN")
            .iter()
            .any(|r| r.args.contains("install") && r.args.contains("ca-certificates")),
        "ca-certificates"
    );
}

#[test]
fn dependencies_are_built_in_a_layer_of_their_own() {
    let (_, stages) = dockerfile();
    let builder = &stages[0];
    let manifest = builder
        .position(|i| i.keyword == "COPY" && i.args.contains("Cargo.toml") && i.args.contains("Cargo.lock"))
        .expect("COPY Cargo.toml Cargo.lock");
    let deps = builder
        .position(|i| i.keyword == "RUN" && i.args.contains("cargo build"))
        .expect("RUN cargo build");
    let sources = builder
        .position(|i| i.keyword == "COPY" && i.flags_and_words().1.first() == Some(&"src"))
        .expect("COPY src");
    assert!(
        manifest < deps && deps < sources,
        "manifest {manifest}, dependency build {deps}, sources {sources}"
    );
    // The manifest copy brings nothing else, so only a dependency change invalidates it.
    let copied = builder.instructions[manifest].flags_and_words().1;
    assert_eq!(copied, ["Cargo.toml", "Cargo.lock", "./"]);
    // Whether cargo can read the manifest at each build, whatever targets it declares, is
    // checked by replaying the stage (every_cargo_build_in_the_builder_...).
    let dependency_build = &builder.instructions[deps].args;
    assert!(dependency_build.contains("--locked"), "{dependency_build}");
    // After the real sources, cargo must rebuild over the stand-ins whatever their mtimes.
    let rebuild = builder.instructions[sources + 1..]
        .iter()
        .find(|i| i.keyword == "RUN" && i.args.contains("cargo build"))
        .expect("RUN cargo build after COPY src");
    assert!(
        rebuild.args.contains("touch src/main.rs src/lib.rs"),
        "{rebuild:?}"
    );
}

/// The keys of a Cargo manifest that declare targets.
const TARGET_KEYS: [&str; 5] = ["lib", "bin", "bench", "example", "test"];

/// A manifest's text parsed, without the tables that declare targets.
fn without_targets(manifest: &str) -> toml::Table {
    let mut table: toml::Table = manifest.parse().expect("Cargo.toml parses");
    for key in TARGET_KEYS {
        table.remove(key);
    }
    table
}

/// One `cargo` call of a replayed builder stage: its arguments, and a copy of the working
/// directory (without `target/`) as it stood when cargo was called.
struct CargoCall {
    args: Vec<String>,
    tree: PathBuf,
}

/// A builder stage run on this machine ([`replay`]).
struct Replay {
    _dir: tempfile::TempDir,
    calls: Vec<CargoCall>,
}

/// `cargo` while a builder stage is replayed: records the call and the working directory,
/// then puts the floodgate binary under test where `cargo build --release` would.
const CARGO_STAND_IN: &str = r#"#!/bin/sh
set -e
call="$REPLAY_CALLS/$(ls "$REPLAY_CALLS" | wc -l)"
mkdir -p "$call/tree"
printf '%s\n' "$@" > "$call/args"
tar --exclude=./target -cf - . | tar -xf - -C "$call/tree"
mkdir -p target/release
ln -sf "$REPLAY_FLOODGATE" target/release/floodgate
"#;

/// Copies `source` (relative to the repository) to `dest` as `COPY source dest` does, less
/// what `.dockerignore` keeps out of the build context.
fn copy_from_context(patterns: &[String], source: &str, dest: &Path, into_dir: bool) -> Result<(), String> {
    if ignored(patterns, source) {
        return Err(format!("COPY {source}: excluded by .dockerignore"));
    }
    let from = repo().join(source);
    let to = if from.is_file() && into_dir {
        dest.join(from.file_name().unwrap())
    } else {
        dest.to_owned()
    };
    if from.is_file() {
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&from, &to).map_err(|e| format!("COPY {source}: {e}"))?;
        return Ok(());
    }
    let entries = std::fs::read_dir(&from).map_err(|e| format!("COPY {source}: {e}"))?;
    std::fs::create_dir_all(&to).unwrap();
    for entry in entries {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let child = format!("{source}/{name}");
        if !ignored(patterns, &child) {
            copy_from_context(patterns, &child, &to.join(&name), false)?;
        }
    }
    Ok(())
}

/// Runs the first stage of `dockerfile` on this machine, in a temporary directory standing
/// for its `WORKDIR`: `COPY` takes files from the repository (less what `.dockerignore`
/// excludes), `ENV` sets variables and `RUN` runs with `/bin/sh -c`, as Docker does, with
/// `cargo` replaced by [`CARGO_STAND_IN`] (so the stage's own checks, `floodgate --version`
/// and `floodgate check`, run the real binary). An error names the failing instruction.
fn replay(dockerfile: &str) -> Result<Replay, String> {
    use std::os::unix::fs::PermissionsExt;

    let (_, stages) = stages(dockerfile);
    let builder = stages.first().ok_or("no FROM")?;
    let dir = tempfile::tempdir().unwrap();
    let [work, bin, calls] = ["work", "bin", "calls"].map(|d| dir.path().join(d));
    for d in [&work, &bin, &calls] {
        std::fs::create_dir(d).unwrap();
    }
    let cargo = bin.join("cargo");
    std::fs::write(&cargo, CARGO_STAND_IN).unwrap();
    std::fs::set_permissions(&cargo, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let patterns = dockerignore();
    let mut workdir = String::new();
    let mut env = Vec::new();
    for instruction in &builder.instructions {
        let (flags, words) = instruction.flags_and_words();
        match instruction.keyword.as_str() {
            "ARG" => {}
            "WORKDIR" => workdir = format!("{}/", instruction.args.trim_end_matches('/')),
            "ENV" => {
                for pair in words {
                    let (name, value) = pair.split_once('=').ok_or(format!("ENV {pair}"))?;
                    env.push((name.to_owned(), value.to_owned()));
                }
            }
            "COPY" if flags.is_empty() && words.len() >= 2 => {
                let (dest, sources) = words.split_last().unwrap();
                let relative = match dest.strip_prefix('/') {
                    Some(_) => dest
                        .strip_prefix(workdir.as_str())
                        .ok_or(format!("COPY to {dest}"))?,
                    None => dest,
                };
                let into_dir = dest.ends_with('/') || sources.len() > 1;
                for source in sources {
                    copy_from_context(&patterns, source, &work.join(relative), into_dir)?;
                }
            }
            "RUN" => {
                let mut command = std::process::Command::new("/bin/sh");
                command
                    .arg("-c")
                    .arg(&instruction.args)
                    .current_dir(&work)
                    .envs(env.iter().map(|(k, v)| (k, v)))
                    .env("PATH", &path)
                    .env("REPLAY_CALLS", &calls)
                    .env("REPLAY_FLOODGATE", common::process::BIN);
                for (name, _) in std::env::vars().filter(|(k, _)| k.starts_with("FLOODGATE_")) {
                    command.env_remove(name);
                }
                let output = command.output().unwrap();
                if !output.status.success() {
                    return Err(format!(
                        "RUN {}: {}\n{}",
                        instruction.args,
                        output.status,
                        String::from_utf8_lossy(&output.stderr)
                    ));
                }
            }
            other => return Err(format!("the replay does not know {other} {}", instruction.args)),
        }
    }
    let mut recorded: Vec<(usize, CargoCall)> = std::fs::read_dir(&calls)
        .unwrap()
        .map(|entry| {
            let call = entry.unwrap().path();
            let number = call.file_name().unwrap().to_str().unwrap().parse().unwrap();
            let args = std::fs::read_to_string(call.join("args")).unwrap();
            let args = args.lines().map(str::to_owned).collect();
            (
                number,
                CargoCall {
                    args,
                    tree: call.join("tree"),
                },
            )
        })
        .collect();
    recorded.sort_by_key(|(number, _)| *number);
    Ok(Replay {
        _dir: dir,
        calls: recorded.into_iter().map(|(_, call)| call).collect(),
    })
}

/// Whether cargo accepts the manifest in `tree` with the files there, as `cargo build`
/// would: `cargo fetch` reads the manifest and checks that every target it declares has
/// its file ("can't find `request_path` bench at ...") before it resolves dependencies,
/// which, offline and with an empty CARGO_HOME, is as far as it gets.
fn cargo_reads_the_manifest(tree: &Path) -> Result<(), String> {
    let home = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(env!("CARGO"))
        .args(["fetch", "--offline", "--locked"])
        .current_dir(tree)
        .env("CARGO_HOME", home.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let read = output.status.success()
        || (!stderr.contains("failed to parse manifest") && stderr.contains("--offline"));
    if read { Ok(()) } else { Err(stderr) }
}

/// (kind, name, source path relative to `root`) of each target cargo finds for the manifest
/// in `root`.
fn targets(root: &Path) -> Vec<(String, String, String)> {
    let output = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--no-deps", "--offline", "--format-version", "1"])
        .current_dir(root)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let root = root.canonicalize().unwrap();
    metadata["packages"][0]["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|target| {
            let path = Path::new(target["src_path"].as_str().unwrap());
            (
                target["kind"][0].as_str().unwrap().to_owned(),
                target["name"].as_str().unwrap().to_owned(),
                path.strip_prefix(&root).unwrap_or(path).display().to_string(),
            )
        })
        .collect()
}

/// The files under `dir`, relative to it.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(
                files(&path)
                    .into_iter()
                    .map(|p| Path::new(path.file_name().unwrap()).join(p)),
            );
        } else {
            out.push(PathBuf::from(path.file_name().unwrap()));
        }
    }
    out.sort();
    out
}

/// Cargo refuses a manifest that declares a target (a bench, an example) whose file the
/// builder does not have. Replay the builder stage and have cargo read the manifest and
/// files each `cargo build` sees, whatever targets the manifest declares.
#[test]
fn every_cargo_build_in_the_builder_finds_the_files_of_the_targets_its_manifest_declares() {
    let replay = replay(&read("Dockerfile")).unwrap_or_else(|e| panic!("{e}"));
    let builds: Vec<&CargoCall> = replay
        .calls
        .iter()
        .filter(|c| c.args.first().map(String::as_str) == Some("build"))
        .collect();
    assert!(
        builds.len() >= 2,
        "the dependency build and the real one: {}",
        builds.len()
    );

    // The library and the binary the image ships, as the repository has them.
    let shipped: Vec<_> = targets(&repo())
        .into_iter()
        .filter(|(kind, name, _)| kind == "lib" || (kind == "bin" && name == "floodgate"))
        .collect();
    assert_eq!(shipped.len(), 2, "{shipped:?}");
    let manifest = without_targets(&read("Cargo.toml"));
    for (n, build) in builds.iter().enumerate() {
        let what = format!("cargo build #{n} ({})", build.args.join(" "));
        for flag in ["--release", "--locked"] {
            assert!(build.args.iter().any(|a| a == flag), "{what}: no {flag}");
        }
        if let Err(e) = cargo_reads_the_manifest(&build.tree) {
            panic!("{what}: cargo cannot read the manifest with the files the builder has:\n{e}");
        }
        // Apart from its targets, the manifest is the repository's: its dependencies,
        // features and profiles, so Cargo.lock applies and the dependencies compile as
        // for the real manifest.
        let seen = std::fs::read_to_string(build.tree.join("Cargo.toml")).unwrap();
        assert_eq!(without_targets(&seen), manifest, "{what}: {seen}");
        let found = targets(&build.tree);
        for target in &shipped {
            assert!(found.contains(target), "{what}: {target:?} not among {found:?}");
        }
    }
    // The last build compiles the repository's sources, all of them.
    let last = builds.last().unwrap();
    let sources = repo().join("src");
    for file in files(&sources) {
        let built = std::fs::read(last.tree.join("src").join(&file));
        assert_eq!(
            built.ok(),
            std::fs::read(sources.join(&file)).ok(),
            "src/{}",
            file.display()
        );
    }
}

/// The check above fails for a builder like the one that broke: stand-ins for src/ alone
/// while the manifest declares targets elsewhere.
#[test]
fn the_replayed_builder_fails_when_a_declared_target_has_no_file() {
    let declared: Vec<String> = read("Cargo.toml")
        .parse::<toml::Table>()
        .unwrap()
        .iter()
        .filter(|(key, _)| TARGET_KEYS[1..].contains(&key.as_str()))
        .flat_map(|(kind, tables)| {
            tables
                .as_array()
                .unwrap()
                .iter()
                .map(move |t| format!("`{}` {kind}", t["name"].as_str().unwrap()))
        })
        .collect();
    if declared.is_empty() {
        return; // nothing for a builder to miss
    }
    let broken = "FROM rust:1-slim-bookworm AS builder\n\
                  WORKDIR /build\n\
                  COPY Cargo.toml Cargo.lock ./\n\
                  RUN mkdir src && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \\\n \
                  && cargo build --release --locked --bin floodgate\n";
    let replay = replay(broken).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(replay.calls.len(), 1);
    let error = cargo_reads_the_manifest(&replay.calls[0].tree).expect_err("cargo reads the manifest");
    assert!(
        declared
            .iter()
            .any(|target| error.contains(&format!("can't find {target}"))),
        "{declared:?}: {error}"
    );
}

#[test]
fn the_runtime_runs_as_a_non_root_user() {
    let (_, stages) = dockerfile();
    let runtime = final_stage(&stages);
    let user = runtime.last("USER").expect("USER in the final stage");
    let name = user.args.split(':').next().unwrap();
    assert!(!["root", "0", ""].contains(&name), "USER {}", user.args);
    let uid: u32 = name.parse().expect("a numeric uid (runAsNonRoot can check it)");
    assert!(uid >= 1000, "uid {uid}");
    // The uid exists in the image.
    assert!(
        runtime
            .all("RUN")
            .iter()
            .any(|r| r.args.contains("useradd") && r.args.contains(&format!("--uid {uid}"))),
        "no useradd --uid {uid}"
    );
    // Nothing after USER switches back to root.
    let position = runtime
        .position(|i| i.keyword == "USER")
        .expect("USER in the final stage");
    assert!(
        runtime.instructions[position..]
            .iter()
            .filter(|i| i.keyword == "USER")
            .all(|i| i.args == user.args)
    );
}

#[test]
fn the_config_lives_at_etc_floodgate_and_every_command_reads_it() {
    let (_, stages) = dockerfile();
    let runtime = final_stage(&stages);
    let copy = runtime
        .all("COPY")
        .into_iter()
        .find(|c| c.flags_and_words().1.last() == Some(&CONFIG_PATH))
        .expect("COPY ... /etc/floodgate/gateway.toml");
    assert!(copy.args.contains("gateway.toml"), "{copy:?}");
    let env = runtime.all("ENV");
    assert!(
        env.iter()
            .any(|e| e.args == format!("FLOODGATE_CONFIG={CONFIG_PATH}")),
        "ENV FLOODGATE_CONFIG={CONFIG_PATH}: {env:?}"
    );
    // Built from the shipped file: the builder copies it from the context.
    let (_, builder_words) = stages[0]
        .all("COPY")
        .into_iter()
        .find(|c| c.args.starts_with("gateway.toml"))
        .expect("COPY gateway.toml in the builder")
        .flags_and_words();
    assert_eq!(builder_words[0], "gateway.toml");
    // The image validates its config at build time, as the user it runs as.
    let user = runtime.position(|i| i.keyword == "USER").unwrap();
    let check = runtime
        .position(|i| i.keyword == "RUN" && i.exec_form("") == Some(vec!["floodgate".into(), "check".into()]))
        .expect("RUN [\"floodgate\", \"check\"]");
    assert!(check > user);
}

/// The substitution the builder applies to the shipped gateway.toml.
const ADMIN_SED: &str = r#"s/^admin_listen = "127\.0\.0\.1:9901"/admin_listen = "0.0.0.0:9901"/"#;

#[test]
fn the_container_config_is_the_shipped_file_with_the_admin_listener_on_every_address() {
    let (_, stages) = dockerfile();
    let sed = stages[0]
        .all("RUN")
        .into_iter()
        .find(|r| r.args.contains("sed -i"))
        .expect("the builder rewrites admin_listen");
    assert!(
        sed.args.contains(&format!("'{ADMIN_SED}' gateway.toml")),
        "{sed:?}"
    );
    assert!(
        sed.args.contains("floodgate check --config gateway.toml"),
        "{sed:?}"
    );

    // The shipped file has exactly the lines the substitution and its guard expect.
    let shipped = read("gateway.toml");
    let count = |line: &str| shipped.lines().filter(|l| l.starts_with(line)).count();
    assert_eq!(count("admin_listen = \"127.0.0.1:9901\""), 1, "{shipped}");
    assert_eq!(count("admin_listen ="), 1);
    assert_eq!(count("listen = \"0.0.0.0:8080\""), 1);

    // Apply it as sed would and have the real binary validate the result.
    let container: String = shipped
        .lines()
        .map(
            |line| match line.strip_prefix("admin_listen = \"127.0.0.1:9901\"") {
                Some(rest) => format!("admin_listen = \"0.0.0.0:9901\"{rest}\n"),
                None => format!("{line}\n"),
            },
        )
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, &container).unwrap();
    let output = run(
        dir.path(),
        &["check"],
        &[("FLOODGATE_CONFIG", path.to_str().unwrap())],
        Duration::from_secs(10),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("listen 0.0.0.0:8080, admin 0.0.0.0:9901"),
        "{stdout}"
    );
}

#[test]
fn ports_signal_health_labels_and_entrypoint() {
    let (_, stages) = dockerfile();
    let runtime = final_stage(&stages);

    let exposed: Vec<&str> = runtime
        .all("EXPOSE")
        .iter()
        .flat_map(|e| e.args.split_whitespace())
        .collect();
    assert_eq!(exposed, ["8080", "9901"]);

    assert_eq!(runtime.last("STOPSIGNAL").expect("STOPSIGNAL").args, "SIGTERM");

    let health = runtime.last("HEALTHCHECK").expect("HEALTHCHECK");
    let (flags, _) = health.flags_and_words();
    let cmd_at = health.args.find("CMD").expect("HEALTHCHECK ... CMD");
    let command: Vec<String> =
        serde_json::from_str(health.args[cmd_at + 3..].trim()).expect("HEALTHCHECK CMD in exec form");
    assert_eq!(&command[..2], ["floodgate", "healthcheck"], "{command:?}");
    // Docker's own timeout must leave the probe time to report.
    let docker_timeout = flags
        .iter()
        .find_map(|f| f.strip_prefix("--timeout="))
        .map(|t| humantime::parse_duration(t).unwrap())
        .unwrap_or(Duration::from_secs(30));
    let probe_timeout = command
        .iter()
        .position(|a| a == "--timeout")
        .map(|i| humantime::parse_duration(&command[i + 1]).unwrap())
        .unwrap_or(Duration::from_secs(2));
    assert!(
        probe_timeout < docker_timeout,
        "{probe_timeout:?} vs {docker_timeout:?}"
    );

    let labels: String = runtime
        .all("LABEL")
        .iter()
        .map(|l| l.args.as_str())
        .collect::<Vec<_>>()
        .join(" ");
    for key in ["title", "description", "version"] {
        assert!(
            labels.contains(&format!("org.opencontainers.image.{key}=")),
            "LABEL org.opencontainers.image.{key}: {labels}"
        );
    }
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        runtime
            .all("ARG")
            .iter()
            .any(|a| a.args == format!("VERSION={version}")),
        "ARG VERSION={version}"
    );

    // Exec form: floodgate is PID 1 and receives SIGTERM/SIGHUP itself (a shell form would
    // put /bin/sh in between, which does not forward them).
    let entrypoint = runtime.last("ENTRYPOINT").expect("ENTRYPOINT");
    assert_eq!(entrypoint.exec_form(""), Some(vec!["floodgate".to_owned()]));
    for cmd in runtime.all("CMD") {
        assert!(cmd.exec_form("").is_some(), "CMD in exec form: {cmd:?}");
    }
}

/// `.dockerignore` patterns (comments and blanks dropped, trailing `/` removed).
fn dockerignore() -> Vec<String> {
    read(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.trim_start_matches('/').trim_end_matches('/').to_owned())
        .collect()
}

/// Docker's matching, for the patterns used here: `*` within a path segment, `**` across
/// segments; a pattern matching a directory excludes what is under it.
fn ignored(patterns: &[String], path: &str) -> bool {
    fn segment(pattern: &str, name: &str) -> bool {
        match pattern.split_once('*') {
            None => pattern == name,
            Some((head, tail)) => {
                name.starts_with(head)
                    && (0..=name.len() - head.len()).any(|i| segment(tail, &name[head.len() + i..]))
            }
        }
    }
    fn matches(pattern: &[&str], path: &[&str]) -> bool {
        match (pattern.first(), path.first()) {
            (None, _) => true, // a directory match covers what is under it
            (Some(&"**"), _) => (0..=path.len()).any(|i| matches(&pattern[1..], &path[i..])),
            (Some(p), Some(name)) => segment(p, name) && matches(&pattern[1..], &path[1..]),
            (Some(_), None) => false,
        }
    }
    let path: Vec<&str> = path.split('/').collect();
    let mut excluded = false;
    for pattern in patterns {
        let (negated, pattern) = match pattern.strip_prefix('!') {
            Some(p) => (true, p),
            None => (false, pattern.as_str()),
        };
        if matches(&pattern.split('/').collect::<Vec<_>>(), &path) {
            excluded = !negated;
        }
    }
    excluded
}

#[test]
fn dockerignore_keeps_build_output_and_history_out_of_the_context() {
    let patterns = dockerignore();
    for path in ["target", "target/release/floodgate", ".git", ".git/HEAD"] {
        assert!(ignored(&patterns, path), "{path} is sent to the build");
    }
    // ...but everything the Dockerfile copies from the context is there.
    let (_, stages) = dockerfile();
    let mut sources = Vec::new();
    for stage in &stages {
        for copy in stage.all("COPY") {
            let (flags, words) = copy.flags_and_words();
            if flags.iter().any(|f| f.starts_with("--from=")) {
                continue;
            }
            sources.extend(words[..words.len() - 1].iter().map(|s| s.to_string()));
        }
    }
    assert!(sources.contains(&"src".to_owned()), "{sources:?}");
    for source in &sources {
        assert!(
            repo().join(source).exists(),
            "COPY {source}: not in the repository"
        );
        assert!(
            !ignored(&patterns, source),
            "COPY {source}: excluded by .dockerignore"
        );
    }
    for path in ["src/main.rs", "src/limit/scripts/decide.lua"] {
        assert!(!ignored(&patterns, path), "{path} excluded by .dockerignore");
    }
    // Nothing else: what the repository holds besides those sources (benchmark scripts,
    // tests, examples, documents) stays out of the context, so it cannot change a layer.
    for entry in std::fs::read_dir(repo()).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        assert_eq!(
            ignored(&patterns, &name),
            !sources.contains(&name),
            "{name}: in the build context if and only if the Dockerfile copies it"
        );
    }
    for path in [
        "bench/ab.sh",
        "benches/store.rs",
        "tests/dockerfile.rs",
        "README.md",
        "src/x.rs.bk",
    ] {
        assert!(ignored(&patterns, path), "{path} is sent to the build");
    }
}

#[test]
fn the_compose_example_builds_this_image_and_mounts_its_config_where_the_image_reads_it() {
    let compose = read("examples/compose/docker-compose.yml");
    let compose_dir = repo().join("examples/compose");
    assert!(
        compose.contains("context: ../..\n"),
        "floodgate is built from the repository root"
    );
    assert!(compose.contains("dockerfile: Dockerfile\n"));
    assert!(compose_dir.join("../..").join("Dockerfile").exists());
    assert!(
        compose.contains(&format!("- ./gateway.toml:{CONFIG_PATH}:ro\n")),
        "the example's gateway.toml is mounted where the image reads its config"
    );
    for (line, expected) in [
        ("image: php:8.2-fpm\n", None),
        ("- ./php:/var/www/html:ro\n", Some("php/index.php")),
        ("- ./php:/etc/floodgate/php:ro\n", Some("php/style.css")),
        (
            "- ./php-fpm/pool.conf:/usr/local/etc/php-fpm.d/zz-floodgate.conf:ro\n",
            Some("php-fpm/pool.conf"),
        ),
        ("context: ./go\n", Some("go/Dockerfile")),
        ("image: redis:", None),
    ] {
        assert!(compose.contains(line), "docker-compose.yml: no {line:?}");
        if let Some(file) = expected {
            assert!(compose_dir.join(file).exists(), "{file}");
        }
    }
    assert!(compose_dir.join("php/form.php").exists());

    // The Go image copies only files that exist and builds with the standard library alone.
    let go = stages(&read("examples/compose/go/Dockerfile")).1;
    for copy in go.iter().flat_map(|s| s.all("COPY")) {
        let (flags, words) = copy.flags_and_words();
        if flags.is_empty() {
            for source in &words[..words.len() - 1] {
                assert!(compose_dir.join("go").join(source).exists(), "{source}");
            }
        }
    }
    let go_mod = read("examples/compose/go/go.mod");
    assert!(!go_mod.contains("require"), "standard library only: {go_mod}");

    // The example's gateway config is valid (`check` does not connect to Redis).
    let config = compose_dir.join("gateway.toml");
    let output = run(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        &["check", "--config", config.to_str().unwrap()],
        &[],
        Duration::from_secs(10),
    );
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_dockerignore_matcher_follows_docker() {
    let patterns: Vec<String> = ["target", "**/*.rs.bk", "*.md", "!KEEP.md"]
        .map(String::from)
        .to_vec();
    assert!(ignored(&patterns, "target"));
    assert!(ignored(&patterns, "target/debug/x"));
    assert!(!ignored(&patterns, "src/target.rs"));
    assert!(ignored(&patterns, "src/a.rs.bk"));
    assert!(ignored(&patterns, "README.md"));
    assert!(!ignored(&patterns, "KEEP.md"));
    assert!(
        !ignored(&patterns, "docs/README.md"),
        "*.md is anchored at the root"
    );
}
