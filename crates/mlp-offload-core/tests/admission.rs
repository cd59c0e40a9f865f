//! Node-wide admission: the limit holds across handles and processes, and a process killed while it
//! holds requests gives them back at once.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use mlp_offload_core::admission::NodeAdmission;

/// A device id of this test run alone (the id only names the semaphore's key file).
fn test_device(name: &str) -> String {
    format!("test-{name}-{}:0", std::process::id())
}

const SHORT: Duration = Duration::from_millis(50);

#[test]
fn the_limit_holds_across_handles_and_a_request_given_back_is_taken_again() {
    let device = test_device("limit");
    let (a, b) = (
        NodeAdmission::open(&device, 3).unwrap(),
        NodeAdmission::open(&device, 3).unwrap(),
    );
    assert!(a.acquire(1, SHORT).unwrap());
    assert!(b.acquire(1, SHORT).unwrap());
    assert!(a.acquire(1, SHORT).unwrap());
    assert_eq!(b.in_flight(), 3);
    assert!(
        !b.acquire(1, SHORT).unwrap(),
        "a fourth request passed a limit of 3"
    );
    a.release(1);
    assert!(b.acquire(1, SHORT).unwrap());
    for h in [&a, &b, &b] {
        h.release(1);
    }
    assert_eq!(a.in_flight(), 0);
}

#[test]
fn a_limit_is_reset_only_when_nobody_holds_a_request() {
    let device = test_device("reset");
    let first = NodeAdmission::open(&device, 2).unwrap();
    assert!(first.acquire(1, SHORT).unwrap());
    // Held: the other limit is not taken.
    assert_eq!(NodeAdmission::open(&device, 5).unwrap().limit(), 2);
    first.release(1);
    // Free: the new limit is.
    let second = NodeAdmission::open(&device, 5).unwrap();
    assert_eq!(second.limit(), 5);
    assert_eq!(second.in_flight(), 0);
}

#[test]
fn a_limit_outside_the_semaphores_range_is_refused_by_name() {
    for limit in [0, 40_000] {
        let e = NodeAdmission::open(&test_device("range"), limit).unwrap_err();
        assert!(e.to_string().contains("device_inflight"), "{e}");
    }
}

/// Run by the test below in a child process: takes every request of the device named in the
/// environment, says so, and waits to be killed.
#[test]
#[ignore = "a helper the kill test runs in a child process"]
fn child_holds_every_request() {
    let Ok(device) = std::env::var("MLPO_TEST_ADMISSION_DEVICE") else {
        return;
    };
    let node = NodeAdmission::open(&device, 4).unwrap();
    for _ in 0..4 {
        assert!(node.acquire(1, Duration::from_secs(5)).unwrap());
    }
    println!("holding");
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn a_process_killed_while_it_holds_requests_gives_them_back_at_once() {
    let device = test_device("kill");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_holds_every_request",
            "--ignored",
            "--nocapture",
        ])
        .env("MLPO_TEST_ADMISSION_DEVICE", &device)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(
        lines.any(|l| l.unwrap().contains("holding")),
        "the child never took its requests"
    );
    let node = NodeAdmission::open(&device, 4).unwrap();
    assert_eq!(node.in_flight(), 4);
    assert!(
        !node.acquire(1, SHORT).unwrap(),
        "a request passed while the child held all 4"
    );
    // A waiter already queued in the kernel is served the moment the child dies.
    let waiter = std::thread::spawn({
        let device = device.clone();
        move || {
            let node = NodeAdmission::open(&device, 4).unwrap();
            let t = Instant::now();
            let got = node.acquire(1, Duration::from_secs(30)).unwrap();
            node.release(1);
            (got, t.elapsed())
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let killed = Instant::now();
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let (got, waited) = waiter.join().unwrap();
    assert!(got);
    assert!(
        waited < Duration::from_secs(5) && killed.elapsed() < Duration::from_secs(5),
        "the waiter was served {:?} after the kill",
        killed.elapsed()
    );
    assert_eq!(
        node.in_flight(),
        0,
        "the dead child's requests were not all given back"
    );
}
