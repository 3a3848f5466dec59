//! `temper tasks` end to end: the example tasks under the oracle, a job
//! killed with SIGKILL and resumed, and `temper view` on a job.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks")
}

/// False (and a SKIPPED line) where this host gives no namespaces: trials
/// need the sandbox, like the sandbox's own tests.
fn sandbox_usable(test: &str) -> bool {
    use temper_sandbox::{ExecRequest, Language, Sandbox, SandboxConfig};
    let ok = Sandbox::new(SandboxConfig::default())
        .and_then(|s| s.run(&ExecRequest::new(Language::Bash, "true")));
    if let Err(e) = &ok {
        eprintln!("SKIPPED {test}: namespaces unavailable on this host: {e}");
    }
    ok.is_ok()
}

fn temper(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_temper"))
        .args(args)
        .output()
        .expect("temper runs")
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn oracle_job_prints_the_summary_and_view_writes_a_report() {
    if !sandbox_usable("oracle_job_prints_the_summary_and_view_writes_a_report") {
        return;
    }
    let jobs = tempfile::tempdir().expect("tempdir");
    let jobs_dir = jobs.path().to_string_lossy().into_owned();
    let ex = examples().to_string_lossy().into_owned();
    let o = temper(&[
        "tasks",
        "run",
        &ex,
        "-a",
        "oracle",
        "-c",
        "4",
        "--jobs-dir",
        &jobs_dir,
        "--job-name",
        "j1",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let total = out
        .lines()
        .find(|l| l.starts_with("total"))
        .expect("a total row");
    assert!(total.contains("10/10") && total.contains("1.000"), "{out}");
    let job = jobs.path().join("j1");
    let result: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(job.join("result.json")).expect("job result"),
    )
    .expect("json");
    assert_eq!(result["stats"]["n_trials"], 10);
    assert_eq!(result["stats"]["mean_reward"], 1.0);

    let o = temper(&["view", &job.to_string_lossy()]);
    assert!(o.status.success(), "{}", text(&o));
    let html = std::fs::read_to_string(job.join("report.html")).expect("report.html");
    assert!(html.contains("patch-python-bug") && html.contains("trajectory.json"));

    // A second run into the same job name is refused, not merged.
    let o = temper(&[
        "tasks",
        "run",
        &ex,
        "-a",
        "nop",
        "--jobs-dir",
        &jobs_dir,
        "--job-name",
        "j1",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("temper tasks resume"), "{}", text(&o));
}

fn make_task(root: &Path, name: &str, solve: &str) {
    let dir = root.join(name);
    for d in ["environment", "tests", "solution"] {
        std::fs::create_dir_all(dir.join(d)).expect("mkdir");
    }
    std::fs::write(dir.join("instruction.md"), "Write ok to /app/ok.txt\n").expect("write");
    std::fs::write(dir.join("task.toml"), "version = \"1.0\"\n").expect("write");
    std::fs::write(dir.join("environment/Dockerfile"), "WORKDIR /app\n").expect("write");
    std::fs::write(
        dir.join("tests/test.sh"),
        "if [ \"$(cat /app/ok.txt)\" = ok ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n",
    )
    .expect("write");
    std::fs::write(dir.join("solution/solve.sh"), solve).expect("write");
}

fn results_in(job: &Path) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(job) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path().join("result.json"))
        .filter(|p| p.is_file() && p.parent() != Some(job))
        .collect();
    v.sort();
    v
}

#[test]
fn a_job_killed_midway_resumes_without_rerunning_finished_trials() {
    if !sandbox_usable("a_job_killed_midway_resumes_without_rerunning_finished_trials") {
        return;
    }
    let root = tempfile::tempdir().expect("tempdir");
    let tasks = root.path().join("tasks");
    let marker = "2.7183";
    make_task(&tasks, "a-fast", "echo ok > /app/ok.txt\n");
    make_task(
        &tasks,
        "b-slow",
        &format!("sleep {marker}; echo ok > /app/ok.txt\n"),
    );
    make_task(
        &tasks,
        "c-slow",
        &format!("sleep {marker}; echo ok > /app/ok.txt\n"),
    );
    let jobs = root.path().join("jobs");
    let mut child = Command::new(env!("CARGO_BIN_EXE_temper"))
        .args([
            "tasks",
            "run",
            &tasks.to_string_lossy(),
            "-a",
            "oracle",
            "-c",
            "1",
        ])
        .args(["--jobs-dir", &jobs.to_string_lossy(), "--job-name", "k"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn");
    let job = jobs.join("k");
    let t0 = Instant::now();
    while results_in(&job).is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(30), "no trial finished");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Let the slow trial start, then kill the whole process hard.
    std::thread::sleep(Duration::from_millis(500));
    child.kill().expect("kill");
    child.wait().expect("wait");
    let finished = results_in(&job);
    assert_eq!(finished.len(), 1, "{finished:?}");
    let before = std::fs::read_to_string(&finished[0]).expect("read");
    // The killed trial's sandbox went with the process.
    std::thread::sleep(Duration::from_millis(300));
    let left: Vec<String> = std::fs::read_dir("/proc")
        .expect("proc")
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(marker))
        .collect();
    assert!(
        left.is_empty(),
        "processes outlived the killed job: {left:?}"
    );

    let o = temper(&["tasks", "resume", &job.to_string_lossy()]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("2 of 3 trials left to run"), "{out}");
    assert!(out.contains("(3 trials, 1 resumed, 0 errors"), "{out}");
    let total = out.lines().find(|l| l.starts_with("total")).expect("total");
    assert!(total.contains("3/3") && total.contains("1.000"), "{out}");
    assert_eq!(std::fs::read_to_string(&finished[0]).expect("read"), before);
}

#[test]
fn a_command_agent_acts_through_temper_tasks_exec() {
    if !sandbox_usable("a_command_agent_acts_through_temper_tasks_exec") {
        return;
    }
    let jobs = tempfile::tempdir().expect("tempdir");
    let task = examples().join("hello-file");
    let program = format!(
        "{} tasks exec -- 'echo Hello, world! > /app/hello.txt && pwd'",
        env!("CARGO_BIN_EXE_temper")
    );
    let o = temper(&[
        "tasks",
        "run",
        &task.to_string_lossy(),
        "-a",
        "command",
        "--agent-command",
        &program,
        "--jobs-dir",
        &jobs.path().to_string_lossy(),
        "--job-name",
        "cmd",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let total = out.lines().find(|l| l.starts_with("total")).expect("total");
    assert!(total.contains("1/1") && total.contains("1.000"), "{out}");
    let trial = std::fs::read_dir(jobs.path().join("cmd"))
        .expect("job dir")
        .flatten()
        .map(|e| e.path())
        .find(|p| p.is_dir())
        .expect("a trial dir");
    let stdout =
        std::fs::read_to_string(trial.join("agent/command-stdout.txt")).expect("program stdout");
    assert_eq!(stdout.trim(), "/app");
}
