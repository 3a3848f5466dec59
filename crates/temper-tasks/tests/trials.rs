//! Trials end to end in the real sandbox: the example tasks under the
//! oracle and nop agents, limits, resume, ATIF, and the terminal and
//! command agents against a scripted OpenAI-compatible endpoint.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use temper_tasks::job::{job_results, AgentSpec};
use temper_tasks::{build_agent, discover, plan_job, run_job, run_trial, Task, TrialOptions};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/tasks")
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

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

fn spec(name: &str) -> AgentSpec {
    AgentSpec {
        name: name.into(),
        ..AgentSpec::default()
    }
}

/// Runs `agent` on every example task, 4 at a time; returns task → reward.
fn run_examples(agent: &str) -> Vec<(String, f64, Option<String>)> {
    let rt = runtime();
    let jobs = tempfile::tempdir().expect("tempdir");
    let tasks = discover(&[examples()]).expect("discover");
    assert!(tasks.len() >= 8, "only {} example tasks", tasks.len());
    let (dir, config) = plan_job(&tasks, spec(agent), 1, 4, jobs.path(), None).expect("plan");
    let a = build_agent(&config.agent, None, rt.handle()).expect("agent");
    let job = run_job(&dir, &config, a.as_ref(), &|_, _, _| {}).expect("run");
    assert_eq!(job.stats.n_completed_trials, tasks.len());
    let results = job_results(&dir, &config);
    for r in &results {
        let tdir = dir.join(&r.trial_name);
        assert!(
            tdir.join("agent/trajectory.json").is_file(),
            "{}: {:?}",
            r.trial_name,
            r.exception_info
        );
        validate_atif(&tdir.join("agent/trajectory.json"));
        // What Harbor's models require (tests/python/test_harbor_job.py
        // checks them with Harbor itself).
        assert_eq!(
            r.id.len(),
            36,
            "{}: id {} is not a UUID",
            r.trial_name,
            r.id
        );
        assert_eq!(
            r.task_checksum,
            temper_tasks::harbor::task_checksum(&examples().join(&r.task_name)).expect("checksum")
        );
        assert!(r.config["task"].get("name").is_none(), "{}", r.config);
        assert_eq!(
            r.config["environment"]["import_path"],
            temper_tasks::harbor::SANDBOX_IMPORT_PATH
        );
        assert!(r.config["environment"].get("type").is_none());
    }
    results
        .into_iter()
        .map(|r| {
            (
                r.task_name.clone(),
                r.reward(),
                r.exception_info
                    .map(|e| format!("{}: {}", e.exception_type, e.exception_message)),
            )
        })
        .collect()
}

fn validate_atif(path: &Path) {
    let schema: Value = serde_json::from_str(include_str!("../schema/atif-v1.5.schema.json"))
        .expect("schema parses");
    let validator = jsonschema::validator_for(&schema).expect("schema compiles");
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{}: {errors:?}", path.display());
    // Harbor also requires step ids 1, 2, 3, ...
    let steps = doc["steps"].as_array().expect("steps");
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step_id"], json!(i + 1), "{}", path.display());
    }
}

#[test]
fn oracle_solves_every_example_task() {
    if !sandbox_usable("oracle_solves_every_example_task") {
        return;
    }
    for (task, reward, err) in run_examples("oracle") {
        assert_eq!(reward, 1.0, "{task}: {err:?}");
        assert_eq!(err, None, "{task}");
    }
}

#[test]
fn nop_solves_no_example_task() {
    if !sandbox_usable("nop_solves_no_example_task") {
        return;
    }
    for (task, reward, err) in run_examples("nop") {
        assert_eq!(reward, 0.0, "{task}: {err:?}");
        assert_eq!(err, None, "{task}");
    }
}

/// A throwaway task in `root/name` with the given solve.sh and limits.
fn make_task(root: &Path, name: &str, solve: &str, toml_extra: &str, test: &str) -> Task {
    let dir = root.join(name);
    for d in ["environment", "tests", "solution"] {
        std::fs::create_dir_all(dir.join(d)).expect("mkdir");
    }
    std::fs::write(dir.join("instruction.md"), "Write ok to /app/ok.txt\n").expect("write");
    std::fs::write(
        dir.join("task.toml"),
        format!("version = \"1.0\"\n{toml_extra}\n"),
    )
    .expect("write");
    std::fs::write(dir.join("environment/Dockerfile"), "FROM x\nWORKDIR /app\n").expect("write");
    std::fs::write(dir.join("tests/test.sh"), test).expect("write");
    std::fs::write(dir.join("solution/solve.sh"), solve).expect("write");
    Task::load(&dir).expect("load")
}

const OK_TEST: &str = "if [ \"$(cat /app/ok.txt)\" = ok ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n";

fn host_processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        if let Ok(cmd) = std::fs::read(e.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(marker) {
                found.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
            }
        }
    }
    found
}

fn host_mounts() -> usize {
    std::fs::read_to_string("/proc/self/mountinfo")
        .expect("mountinfo")
        .lines()
        .count()
}

#[test]
fn an_agent_past_its_timeout_is_killed_and_the_verifier_still_runs() {
    if !sandbox_usable("an_agent_past_its_timeout_is_killed_and_the_verifier_still_runs") {
        return;
    }
    let root = tempfile::tempdir().expect("tempdir");
    // Background sleepers named by a marker, then a hang: all must die.
    let marker = "9137.5";
    let task = make_task(
        root.path(),
        "hangs",
        &format!("echo ok > /app/ok.txt\nsleep {marker} &\nsleep {marker} &\nsleep {marker}\n"),
        "[agent]\ntimeout_sec = 1.0\n[verifier]\ntimeout_sec = 10.0",
        OK_TEST,
    );
    let mounts = host_mounts();
    let t0 = std::time::Instant::now();
    let r = run_trial(
        &task,
        &temper_tasks::Oracle,
        &root.path().join("t1"),
        &TrialOptions::default(),
    )
    .expect("trial");
    assert!(t0.elapsed().as_secs_f64() < 8.0, "took {:?}", t0.elapsed());
    let e = r.exception_info.as_ref().expect("an exception");
    assert_eq!(e.exception_type, "AgentTimeoutError");
    // Harbor semantics: the work done before the kill is still verified.
    assert_eq!(r.reward(), 1.0);
    assert!(r.verifier.is_some());
    assert!(
        host_processes_with(marker).is_empty(),
        "{:?}",
        host_processes_with(marker)
    );
    assert_eq!(host_mounts(), mounts, "mounts left behind on the host");
    let saved: Value = serde_json::from_str(
        &std::fs::read_to_string(root.path().join("t1/result.json")).expect("result.json"),
    )
    .expect("json");
    assert_eq!(
        saved["exception_info"]["exception_type"],
        "AgentTimeoutError"
    );
}

#[test]
fn a_verifier_past_its_timeout_is_recorded() {
    if !sandbox_usable("a_verifier_past_its_timeout_is_recorded") {
        return;
    }
    let root = tempfile::tempdir().expect("tempdir");
    let task = make_task(
        root.path(),
        "slowtest",
        "echo ok > /app/ok.txt\n",
        "[verifier]\ntimeout_sec = 0.5",
        "sleep 30\necho 1 > /logs/verifier/reward.txt\n",
    );
    let r = run_trial(
        &task,
        &temper_tasks::Oracle,
        &root.path().join("t"),
        &TrialOptions::default(),
    )
    .expect("trial");
    assert_eq!(
        r.exception_info.as_ref().map(|e| e.exception_type.as_str()),
        Some("VerifierTimeoutError")
    );
    assert_eq!(r.reward(), 0.0);
}

#[test]
fn a_trial_over_its_memory_is_killed_and_recorded() {
    if !sandbox_usable("a_trial_over_its_memory_is_killed_and_recorded") {
        return;
    }
    let root = tempfile::tempdir().expect("tempdir");
    // One process over memory_mb: RLIMIT_AS makes the allocation fail.
    let one = make_task(
        root.path(),
        "hog1",
        "python3 -c 'x = bytearray(400 << 20)'\necho ok > /app/ok.txt\n",
        "[environment]\nmemory_mb = 128",
        OK_TEST,
    );
    let r = run_trial(
        &one,
        &temper_tasks::Oracle,
        &root.path().join("t1"),
        &TrialOptions::default(),
    )
    .expect("trial");
    let log = std::fs::read_to_string(root.path().join("t1/agent/oracle.txt")).unwrap_or_default();
    assert!(log.contains("MemoryError"), "{log}");
    // Four processes under RLIMIT_AS each, over memory_mb together: the
    // cgroup kills the whole session, and the trial records it.
    let many = make_task(
        root.path(),
        "hog4",
        "for i in 1 2 3 4; do python3 -c 'import time; x = b\"1\" * (70 << 20); time.sleep(5)' & done; wait\n",
        "[environment]\nmemory_mb = 128",
        OK_TEST,
    );
    let t0 = std::time::Instant::now();
    let r4 = run_trial(
        &many,
        &temper_tasks::Oracle,
        &root.path().join("t4"),
        &TrialOptions::default(),
    )
    .expect("trial");
    let sandbox =
        temper_sandbox::Sandbox::new(temper_sandbox::SandboxConfig::default()).expect("sandbox");
    match sandbox.run_limits() {
        temper_sandbox::RunLimits::Rlimits(why) => {
            eprintln!("no writable cgroup ({why}): only the per-process limit is checked");
        }
        _ => {
            let e = r4.exception_info.as_ref().expect("an exception");
            assert_eq!(e.exception_type, "MemoryLimitExceeded", "{e:?}");
            assert!(
                r4.verifier.is_none(),
                "the session died with the memory kill"
            );
            assert_eq!(r4.reward(), 0.0);
            assert!(
                t0.elapsed().as_secs_f64() < 4.5,
                "not killed: {:?}",
                t0.elapsed()
            );
        }
    }
    // The failed allocation was the program's error, not the trial's.
    assert!(r.exception_info.is_none(), "{:?}", r.exception_info);
}

#[test]
fn a_killed_job_resumes_without_rerunning_finished_trials() {
    if !sandbox_usable("a_killed_job_resumes_without_rerunning_finished_trials") {
        return;
    }
    let rt = runtime();
    let root = tempfile::tempdir().expect("tempdir");
    let tasks: Vec<Task> = ["a", "b", "c"]
        .iter()
        .map(|n| make_task(root.path(), n, "echo ok > /app/ok.txt\n", "", OK_TEST))
        .collect();
    let jobs = root.path().join("jobs");
    let (dir, config) =
        plan_job(&tasks, spec("oracle"), 1, 2, &jobs, Some("j".into())).expect("plan");
    let agent = build_agent(&config.agent, None, rt.handle()).expect("agent");
    run_job(&dir, &config, agent.as_ref(), &|_, _, _| {}).expect("run");
    // Simulate a kill during trial "b": its result never got written and
    // it left partial files.
    let b = dir.join(&config.trials[1].trial_name);
    std::fs::remove_file(b.join("result.json")).expect("rm");
    std::fs::write(b.join("partial"), "x").expect("write");
    let before: Vec<String> = [0, 2]
        .iter()
        .map(|i| {
            std::fs::read_to_string(dir.join(&config.trials[*i].trial_name).join("result.json"))
                .expect("read")
        })
        .collect();
    let ran = Arc::new(Mutex::new(Vec::new()));
    let seen = ran.clone();
    let job = run_job(
        &dir,
        &temper_tasks::load_job(&dir).expect("load"),
        agent.as_ref(),
        &move |r, _, _| seen.lock().expect("lock").push(r.trial_name.clone()),
    )
    .expect("resume");
    assert_eq!(
        *ran.lock().expect("lock"),
        vec![config.trials[1].trial_name.clone()]
    );
    assert_eq!(job.stats.n_resumed, 2);
    assert_eq!(job.stats.n_completed_trials, 3);
    assert_eq!(job.stats.mean_reward, 1.0);
    assert!(
        !b.join("partial").exists(),
        "the partial trial dir was not discarded"
    );
    for (k, i) in [0, 2].iter().enumerate() {
        let now =
            std::fs::read_to_string(dir.join(&config.trials[*i].trial_name).join("result.json"))
                .expect("read");
        assert_eq!(now, before[k], "a finished trial ran again");
    }
}

/// A scripted OpenAI-compatible endpoint: answers turn `i` (counted by
/// the assistant messages in the request) with `script[i]`, reports 100
/// prompt and 10 completion tokens per call, and keeps every request.
async fn scripted(script: Vec<&'static str>) -> (String, Arc<Mutex<Vec<Value>>>) {
    use axum::{routing::post, Json, Router};
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move |Json(body): Json<Value>| {
            let log = log.clone();
            let script = script.clone();
            async move {
                let turn = body["messages"]
                    .as_array()
                    .map_or(0, |m| m.iter().filter(|m| m["role"] == "assistant").count());
                log.lock().expect("lock").push(body);
                let text = script.get(turn).copied().unwrap_or("TASK_COMPLETE");
                Json(json!({
                    "id": "x", "object": "chat.completion", "model": "scripted",
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}
                }))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/v1"), seen)
}

const SCRIPT: &[&str] = &[
    "Let me check the shell.\n```bash\necho probe-$((6 * 7)); pwd\n```",
    "```bash\necho 'Hello, world!' > hello.txt\n```",
    "Done. TASK_COMPLETE",
];

fn terminal_trial(
    max_turns: Option<u32>,
    max_total_tokens: Option<u64>,
) -> (
    temper_tasks::TrialResult,
    Vec<Value>,
    PathBuf,
    tempfile::TempDir,
) {
    let rt = runtime();
    let (url, seen) = rt.block_on(scripted(SCRIPT.to_vec()));
    let agent = build_agent(
        &AgentSpec {
            name: "terminal".into(),
            model: Some("scripted".into()),
            base_url: Some(url),
            max_turns,
            max_total_tokens,
            ..AgentSpec::default()
        },
        None,
        rt.handle(),
    )
    .expect("agent");
    let task = Task::load(&examples().join("hello-file")).expect("task");
    let root = tempfile::tempdir().expect("tempdir");
    let tdir = root.path().join("hello-file__t");
    let r = run_trial(&task, agent.as_ref(), &tdir, &TrialOptions::default()).expect("trial");
    let requests = seen.lock().expect("lock").clone();
    (r, requests, tdir, root)
}

#[test]
fn terminal_agent_runs_commands_in_the_sandbox_and_sees_their_output() {
    if !sandbox_usable("terminal_agent_runs_commands_in_the_sandbox_and_sees_their_output") {
        return;
    }
    let (r, requests, tdir, _root) = terminal_trial(None, None);
    assert_eq!(r.reward(), 1.0, "{:?}", r.exception_info);
    assert_eq!(requests.len(), 3);
    // Turn 2's request carries turn 1's output, run in the task's workdir.
    let fed_back = requests[1]["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string();
    assert!(fed_back.contains("probe-42"), "{fed_back}");
    assert!(fed_back.contains("/app"), "{fed_back}");
    let meta = r
        .agent_result
        .as_ref()
        .and_then(|a| a.metadata.clone())
        .expect("metadata");
    assert_eq!(meta["stop_reason"], "task_complete");
    assert_eq!(
        r.agent_result.as_ref().and_then(|a| a.n_input_tokens),
        Some(300)
    );
    let path = tdir.join("agent/trajectory.json");
    validate_atif(&path);
    let traj: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json");
    assert_eq!(traj["steps"].as_array().map(Vec::len), Some(4)); // user + 3 turns
    assert_eq!(
        traj["steps"][1]["tool_calls"][0]["arguments"]["command"],
        "echo probe-$((6 * 7)); pwd"
    );
    assert_eq!(traj["final_metrics"]["total_prompt_tokens"], 300);
}

#[test]
fn terminal_agent_stops_at_its_turn_and_token_budgets() {
    if !sandbox_usable("terminal_agent_stops_at_its_turn_and_token_budgets") {
        return;
    }
    let (r, requests, _, _root) = terminal_trial(Some(1), None);
    assert_eq!(requests.len(), 1);
    assert_eq!(r.reward(), 0.0);
    let meta = r
        .agent_result
        .as_ref()
        .and_then(|a| a.metadata.clone())
        .expect("metadata");
    assert_eq!(meta["stop_reason"], "max_turns");

    // 110 tokens per call: a budget of 150 allows two calls.
    let (r, requests, _, _root) = terminal_trial(None, Some(150));
    assert_eq!(requests.len(), 2);
    assert_eq!(
        r.reward(),
        1.0,
        "turn 2 wrote the file before the budget ran out"
    );
    let meta = r
        .agent_result
        .as_ref()
        .and_then(|a| a.metadata.clone())
        .expect("metadata");
    assert_eq!(meta["stop_reason"], "max_total_tokens");
}

#[test]
fn command_agent_gets_the_endpoint_and_runs_commands_through_the_exec_api() {
    if !sandbox_usable("command_agent_gets_the_endpoint_and_runs_commands_through_the_exec_api") {
        return;
    }
    let rt = runtime();
    let root = tempfile::tempdir().expect("tempdir");
    let program = root.path().join("agent.py");
    std::fs::write(
        &program,
        r#"import json, os, sys, urllib.request
instruction = sys.stdin.read()
assert instruction == open(os.environ["TEMPER_INSTRUCTION_FILE"]).read()
def run(cmd):
    req = urllib.request.Request(os.environ["TEMPER_EXEC_URL"],
        data=json.dumps({"command": cmd}).encode(),
        headers={"Authorization": "Bearer " + os.environ["TEMPER_EXEC_TOKEN"],
                 "Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))
r = run("pwd")
assert r["stdout"].strip() == os.environ["TEMPER_WORKDIR"] == "/app", r
r = run("echo 'Hello, world!' > /app/hello.txt && echo " + os.environ["OPENAI_BASE_URL"])
print(r["stdout"].strip(), os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"])
"#,
    )
    .expect("write");
    let agent = build_agent(
        &AgentSpec {
            name: "command".into(),
            model: Some("m1".into()),
            base_url: Some("http://127.0.0.1:9/v1".into()),
            command: Some(format!("python3 {}", program.display())),
            ..AgentSpec::default()
        },
        None,
        rt.handle(),
    )
    .expect("agent");
    let task = Task::load(&examples().join("hello-file")).expect("task");
    let tdir = root.path().join("hello-file__c");
    let r = run_trial(&task, agent.as_ref(), &tdir, &TrialOptions::default()).expect("trial");
    let stdout = std::fs::read_to_string(tdir.join("agent/command-stdout.txt")).unwrap_or_default();
    let stderr = std::fs::read_to_string(tdir.join("agent/command-stderr.txt")).unwrap_or_default();
    assert_eq!(r.reward(), 1.0, "{:?} {stderr}", r.exception_info);
    assert_eq!(stdout.trim(), "http://127.0.0.1:9/v1 EMPTY m1", "{stderr}");
    let meta = r
        .agent_result
        .as_ref()
        .and_then(|a| a.metadata.clone())
        .expect("metadata");
    assert_eq!(meta["exec_calls"], 2);
    assert_eq!(meta["exit_code"], 0);
    validate_atif(&tdir.join("agent/trajectory.json"));
}

#[test]
fn allow_internet_shares_the_host_network_only_when_the_operator_opts_in() {
    if !sandbox_usable("allow_internet_shares_the_host_network_only_when_the_operator_opts_in") {
        return;
    }
    // A listener on the host's loopback stands in for "the internet": a
    // trial reaches it only through the host's network namespace.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let root = tempfile::tempdir().expect("tempdir");
    let solve = format!(
        "python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\" \
         && echo ok > /app/ok.txt\n"
    );
    let open = make_task(
        root.path(),
        "net",
        &solve,
        "[environment]\nallow_internet = true",
        OK_TEST,
    );
    let closed = make_task(
        root.path(),
        "nonet",
        &solve,
        "[environment]\nallow_internet = false",
        OK_TEST,
    );
    let opted_in = TrialOptions {
        allow_internet: true,
        ..TrialOptions::default()
    };
    let run = |task: &Task, options: &TrialOptions, name: &str| {
        run_trial(
            task,
            &temper_tasks::Oracle,
            &root.path().join(name),
            options,
        )
        .expect("trial")
    };
    let r = run(&open, &opted_in, "t1");
    assert_eq!(r.reward(), 1.0, "{:?}", r.temper.notes);
    assert!(r
        .temper
        .notes
        .iter()
        .any(|n| n.contains("shares the host's network")));
    let r = run(&open, &TrialOptions::default(), "t2");
    assert_eq!(r.reward(), 0.0, "reached the host without --allow-internet");
    assert!(r.temper.notes.iter().any(|n| n.contains("not honoured")));
    let r = run(&closed, &opted_in, "t3");
    assert_eq!(r.reward(), 0.0, "allow_internet = false reached the host");
}

#[test]
fn a_symlinked_tests_dir_is_not_followed_into_the_host() {
    if !sandbox_usable("a_symlinked_tests_dir_is_not_followed_into_the_host") {
        return;
    }
    let root = tempfile::tempdir().expect("tempdir");
    let task = make_task(
        root.path(),
        "sneaky",
        "echo ok > /app/ok.txt\n",
        "",
        OK_TEST,
    );
    let real = root.path().join("elsewhere");
    std::fs::rename(task.dir.join("tests"), &real).expect("move");
    std::os::unix::fs::symlink(&real, task.dir.join("tests")).expect("symlink");
    let r = run_trial(
        &task,
        &temper_tasks::Oracle,
        &root.path().join("t"),
        &TrialOptions::default(),
    )
    .expect("trial");
    assert_eq!(r.reward(), 0.0);
    let e = r.exception_info.expect("an exception");
    assert!(e.exception_message.contains("symlink"), "{e:?}");
}

#[test]
fn terminal_agent_stops_at_its_time_budget() {
    if !sandbox_usable("terminal_agent_stops_at_its_time_budget") {
        return;
    }
    let rt = runtime();
    let (url, seen) = rt.block_on(scripted(vec!["```bash\nsleep 30\n```"]));
    let agent = build_agent(
        &AgentSpec {
            name: "terminal".into(),
            model: Some("scripted".into()),
            base_url: Some(url),
            ..AgentSpec::default()
        },
        None,
        rt.handle(),
    )
    .expect("agent");
    let root = tempfile::tempdir().expect("tempdir");
    let task = make_task(
        root.path(),
        "slow",
        "true\n",
        "[agent]\ntimeout_sec = 1.0",
        OK_TEST,
    );
    let t0 = std::time::Instant::now();
    let r = run_trial(
        &task,
        agent.as_ref(),
        &root.path().join("t"),
        &TrialOptions::default(),
    )
    .expect("trial");
    assert!(t0.elapsed().as_secs_f64() < 6.0, "took {:?}", t0.elapsed());
    assert_eq!(
        r.exception_info.as_ref().map(|e| e.exception_type.as_str()),
        Some("AgentTimeoutError")
    );
    let meta = r
        .agent_result
        .as_ref()
        .and_then(|a| a.metadata.clone())
        .expect("metadata");
    assert_eq!(meta["stop_reason"], "timeout");
    assert_eq!(seen.lock().expect("lock").len(), 1);
    assert!(
        r.verifier.is_some(),
        "the verifier runs after an agent timeout"
    );
}

/// Every file under `dir` (recursively) that holds `marker`.
fn files_holding(dir: &Path, marker: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        let Ok(ft) = e.file_type() else { continue };
        if ft.is_dir() {
            out.extend(files_holding(&p, marker));
        } else if ft.is_file()
            && String::from_utf8_lossy(&std::fs::read(&p).unwrap_or_default()).contains(marker)
        {
            out.push(p);
        }
    }
    out
}

const HOST_SECRET: &str = "HOST-SECRET-issue31";

/// How a test case spoils a task directory.
type Spoil<'a> = Box<dyn Fn(&Path) + 'a>;

/// A host file outside every task: what a symlink would leak.
fn host_secret(root: &Path) -> PathBuf {
    let p = root.join("host-secret.txt");
    std::fs::write(&p, format!("{HOST_SECRET}\n")).expect("write");
    p
}

/// Issue 31, item 5: `instruction.md` (and every other file a task
/// contributes at load) that is a symlink, or sits below a symlinked
/// directory, is refused; nothing of the link's target is read.
#[test]
fn issue31_instruction_symlink_is_refused() {
    use std::os::unix::fs::symlink;
    let root = tempfile::tempdir().expect("tempdir");
    let secret = host_secret(root.path());
    let cases: Vec<(&str, Spoil)> = vec![
        (
            "instruction.md -> host file",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("instruction.md")).expect("rm");
                symlink(&secret, d.join("instruction.md")).expect("symlink");
            }),
        ),
        (
            "instruction.md -> /etc/shadow",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("instruction.md")).expect("rm");
                symlink("/etc/shadow", d.join("instruction.md")).expect("symlink");
            }),
        ),
        (
            "task.toml -> host file",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("task.toml")).expect("rm");
                symlink(&secret, d.join("task.toml")).expect("symlink");
            }),
        ),
        (
            "tests/test.sh -> host file",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("tests/test.sh")).expect("rm");
                symlink(&secret, d.join("tests/test.sh")).expect("symlink");
            }),
        ),
        (
            "tests -> a directory outside (a symlinked parent)",
            Box::new(|d: &Path| {
                let outside = d.parent().expect("parent").join("outside-tests");
                std::fs::rename(d.join("tests"), &outside).expect("move");
                symlink(&outside, d.join("tests")).expect("symlink");
            }),
        ),
        (
            "instruction.md a FIFO",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("instruction.md")).expect("rm");
                let ok = std::process::Command::new("mkfifo")
                    .arg(d.join("instruction.md"))
                    .status()
                    .expect("mkfifo")
                    .success();
                assert!(ok);
            }),
        ),
    ];
    for (i, (what, spoil)) in cases.iter().enumerate() {
        let task = make_task(root.path(), &format!("t{i}"), "true\n", "", OK_TEST);
        spoil(&task.dir);
        let e = Task::load(&task.dir).expect_err(what).to_string();
        let why = if what.contains("FIFO") {
            "FIFO"
        } else {
            "symlink"
        };
        assert!(e.contains(why), "{what}: {e}");
        assert!(!e.contains(HOST_SECRET), "{what}: {e}");
        // discover (temper tasks run, temper eval) refuses it the same way.
        assert!(discover(std::slice::from_ref(&task.dir)).is_err(), "{what}");
    }
    // The same directory with plain files loads.
    let fine = make_task(root.path(), "fine", "true\n", "", OK_TEST);
    assert_eq!(fine.instruction, "Write ok to /app/ok.txt\n");
}

/// Issue 31, item 5, at trial time: a symlink in `solution/`,
/// `environment/` (the Dockerfile, a `COPY` source, a file inside a
/// copied directory, the build context itself) or inside `tests/` fails
/// the trial with a clear error and copies nothing of the target in.
#[test]
fn issue31_task_file_symlinks_are_refused_by_every_trial_reader() {
    use std::os::unix::fs::symlink;
    if !sandbox_usable("issue31_task_file_symlinks_are_refused_by_every_trial_reader") {
        return;
    }
    let root = tempfile::tempdir().expect("tempdir");
    let secret = host_secret(root.path());
    // Each case: how to spoil the task, the exception type it must end in.
    let cases: Vec<(&str, Spoil, &str)> = vec![
        (
            "solution/solve.sh -> host file",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("solution/solve.sh")).expect("rm");
                symlink(&secret, d.join("solution/solve.sh")).expect("symlink");
            }),
            "NoSolution",
        ),
        (
            "solution/extra -> host file",
            Box::new(|d: &Path| symlink(&secret, d.join("solution/extra")).expect("symlink")),
            "NoSolution",
        ),
        (
            "environment/Dockerfile -> host file",
            Box::new(|d: &Path| {
                std::fs::remove_file(d.join("environment/Dockerfile")).expect("rm");
                symlink(&secret, d.join("environment/Dockerfile")).expect("symlink");
            }),
            "EnvironmentSetupError",
        ),
        (
            "COPY of a symlink",
            Box::new(|d: &Path| {
                symlink(&secret, d.join("environment/data.txt")).expect("symlink");
                std::fs::write(
                    d.join("environment/Dockerfile"),
                    "WORKDIR /app\nCOPY data.txt /app/\n",
                )
                .expect("write");
            }),
            "EnvironmentSetupError",
        ),
        (
            "COPY of a directory holding a symlink",
            Box::new(|d: &Path| {
                std::fs::create_dir(d.join("environment/lib")).expect("mkdir");
                std::fs::write(d.join("environment/lib/ok.txt"), "ok").expect("write");
                symlink(&secret, d.join("environment/lib/leak.txt")).expect("symlink");
                std::fs::write(
                    d.join("environment/Dockerfile"),
                    "WORKDIR /app\nCOPY lib /app/lib\n",
                )
                .expect("write");
            }),
            "EnvironmentSetupError",
        ),
        (
            "environment -> a directory outside (build context symlinked)",
            Box::new(|d: &Path| {
                let outside = d.parent().expect("parent").join(format!(
                    "outside-env-{}",
                    d.file_name().expect("name").to_string_lossy()
                ));
                std::fs::create_dir(&outside).expect("mkdir");
                std::fs::copy(&secret, outside.join("secret.txt")).expect("copy");
                std::fs::write(
                    outside.join("Dockerfile"),
                    "WORKDIR /app\nCOPY secret.txt /app/\n",
                )
                .expect("write");
                std::fs::remove_dir_all(d.join("environment")).expect("rm");
                symlink(&outside, d.join("environment")).expect("symlink");
            }),
            "EnvironmentSetupError",
        ),
        (
            "tests/data -> host file (a symlink inside tests/)",
            Box::new(|d: &Path| symlink(&secret, d.join("tests/data")).expect("symlink")),
            "VerifierError",
        ),
    ];
    for (i, (what, spoil, kind)) in cases.iter().enumerate() {
        let task = make_task(
            root.path(),
            &format!("t{i}"),
            "echo ok > /app/ok.txt\ncat /app/* /solution/* > /logs/agent/seen.txt 2>&1\n",
            "",
            OK_TEST,
        );
        spoil(&task.dir);
        let tdir = root.path().join(format!("trial{i}"));
        let r = run_trial(
            &task,
            &temper_tasks::Oracle,
            &tdir,
            &TrialOptions::default(),
        )
        .expect("trial");
        let e = r.exception_info.as_ref().expect(what);
        assert_eq!(e.exception_type, *kind, "{what}: {e:?}");
        assert!(e.exception_message.contains("symlink"), "{what}: {e:?}");
        assert_eq!(r.reward(), 0.0, "{what}");
        assert_eq!(
            files_holding(&tdir, HOST_SECRET),
            Vec::<PathBuf>::new(),
            "{what}"
        );
    }
}

/// Issue 31, item 9: a `command` agent's child that leaves its process
/// group (`setsid`, a double fork) dies with the trial: the program runs in
/// its own cgroup and every process in it is killed when it is done.
#[test]
fn issue31_command_agent_setsid_child_is_killed_with_the_trial() {
    if !sandbox_usable("issue31_command_agent_setsid_child_is_killed_with_the_trial") {
        return;
    }
    let probe = temper_sandbox::HostCgroup::new();
    if !probe.is_tracking() {
        eprintln!(
            "SKIPPED issue31_command_agent_setsid_child_is_killed_with_the_trial: no writable \
             cgroup here, so only the program's process group is killed: {}",
            probe.mode()
        );
        return;
    }
    drop(probe);
    let rt = runtime();
    let root = tempfile::tempdir().expect("tempdir");
    let marker = "7919.31";
    // One child in a new session, one double-forked into a new session;
    // the program itself exits at once (its group is then empty).
    let program = format!(
        "setsid sleep {marker} </dev/null >/dev/null 2>&1 &\n\
         ( setsid sh -c 'sleep {marker}1' </dev/null >/dev/null 2>&1 & ) &\n\
         sleep 0.3; echo started"
    );
    let agent = build_agent(
        &AgentSpec {
            name: "command".into(),
            command: Some(program),
            ..AgentSpec::default()
        },
        None,
        rt.handle(),
    )
    .expect("agent");
    let task = make_task(root.path(), "escapes", "true\n", "", OK_TEST);
    let r = run_trial(
        &task,
        agent.as_ref(),
        &root.path().join("t"),
        &TrialOptions::default(),
    )
    .expect("trial");
    let meta = r
        .agent_result
        .as_ref()
        .and_then(|a| a.metadata.clone())
        .expect("metadata");
    assert_eq!(meta["exit_code"], 0, "{meta:?}");
    let cleanup = meta["process_cleanup"].as_str().unwrap_or_default();
    assert!(cleanup.starts_with("cgroup"), "{cleanup}");
    let left = host_processes_with(marker);
    assert!(left.is_empty(), "outlived the trial: {left:?}");
}
