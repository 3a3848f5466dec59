//! Sessions: state persists across commands, timeouts do not end the
//! session, expiry and delete reclaim the sandbox.

use std::collections::BTreeMap;
mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{children, serial, usable_sandbox};
use temper_sandbox::{ExecStatus, Sandbox, Session, SessionConfig, Sessions};

fn sandbox(test: &str) -> Option<Arc<Sandbox>> {
    usable_sandbox(test).map(Arc::new)
}

const T: Duration = Duration::from_secs(10);

#[test]
fn session_state_persists_across_commands() {
    let _serial = serial();
    let Some(sb) = sandbox("session_state_persists") else {
        return;
    };
    let config = SessionConfig {
        env: BTreeMap::from([("GREETING".to_string(), "it's me".to_string())]),
        ..SessionConfig::default()
    };
    let s = Session::new(sb, config).expect("session");
    let none = BTreeMap::new();
    let r = s
        .exec("echo \"$GREETING\" > a.txt; mkdir d", None, &none, T)
        .expect("exec");
    assert_eq!(r.return_code, Some(0), "{}", r.stderr);
    let extra = BTreeMap::from([("X".to_string(), "1".to_string())]);
    let r = s
        .exec("cat ../a.txt; pwd; echo $X", Some("d"), &extra, T)
        .expect("exec");
    assert_eq!(r.stdout, "it's me\n/work/d\n1\n");

    s.upload("up/f.txt", b"uploaded".to_vec()).expect("upload");
    let r = s
        .exec("cat up/f.txt; ln -s /etc/passwd link", None, &none, T)
        .expect("exec");
    assert_eq!(r.stdout, "uploaded");
    assert_eq!(
        s.download("a.txt").expect("download"),
        Some(b"it's me\n".to_vec())
    );
    assert_eq!(
        s.download("link").expect("download"),
        None,
        "symlink followed"
    );
    assert_eq!(s.download("missing").expect("download"), None);
    assert!(s.download("../etc/passwd").is_err());
    assert!(s
        .exec(
            "true",
            None,
            &BTreeMap::from([("1BAD".into(), "x".into())]),
            T
        )
        .is_err());
}

#[test]
fn a_command_timeout_does_not_end_the_session() {
    let _serial = serial();
    let Some(sb) = sandbox("a_command_timeout") else {
        return;
    };
    let s = Session::new(sb, SessionConfig::default()).expect("session");
    let none = BTreeMap::new();
    s.exec("echo kept > k", None, &none, T).expect("exec");
    let r = s
        .exec("sleep 30", None, &none, Duration::from_millis(300))
        .expect("exec");
    assert_eq!(r.status, ExecStatus::TimeLimitExceeded);
    let r = s.exec("cat k", None, &none, T).expect("exec");
    assert_eq!(r.stdout, "kept\n");
}

#[test]
fn sessions_expire_and_are_reclaimed() {
    let _serial = serial();
    let Some(sb) = sandbox("sessions_expire") else {
        return;
    };
    let sessions = Sessions::default();
    let short = SessionConfig {
        idle_timeout: Duration::from_millis(200),
        ..SessionConfig::default()
    };
    let a = sessions.create(sb.clone(), short).expect("create");
    let b = sessions
        .create(sb, SessionConfig::default())
        .expect("create");
    assert_eq!(sessions.list().len(), 2);
    std::thread::sleep(Duration::from_millis(400));
    assert!(sessions.get(&a).is_none(), "idle session still alive");
    assert!(sessions.get(&b).is_some());
    assert!(sessions.delete(&b));
    assert!(!sessions.delete(&b));
    assert!(sessions.list().is_empty());
    assert_eq!(children(), 0, "session sandboxes left running");
}

#[test]
fn writable_dirs_and_files_sent_with_a_command() {
    let _serial = serial();
    let Some(probe) = usable_sandbox("writable_dirs") else {
        return;
    };
    drop(probe);
    let config = temper_sandbox::SandboxConfig {
        writable_dirs: vec!["/app".into(), "/logs/verifier".into()],
        ..temper_sandbox::SandboxConfig::default()
    };
    let sb = Arc::new(Sandbox::new(config).expect("sandbox"));
    let s = Session::new(sb, SessionConfig::default()).expect("session");
    let none = BTreeMap::new();
    let files = BTreeMap::from([("in/data.txt".to_string(), b"payload".to_vec())]);
    let r = s
        .exec_with_files(
            "cp in/data.txt /app/ && echo 1 > /logs/verifier/r",
            None,
            &none,
            T,
            files,
        )
        .expect("exec");
    assert_eq!(r.return_code, Some(0), "{}", r.stderr);
    // The extra directories keep their files across commands; the rest of
    // the root stays read-only.
    let r = s
        .exec(
            "cat /app/data.txt /logs/verifier/r; touch /opt-x 2>/dev/null || echo ro",
            None,
            &none,
            T,
        )
        .expect("exec");
    assert_eq!(r.stdout, "payload1\nro\n");
}
