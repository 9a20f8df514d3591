//! Owns tests of the exchange's channel between threads of one process, over loopback.
//! Keeps: nothing outside loopback is opened.
use super::*;
use std::sync::{mpsc, Arc};

type Store = MemoryStore;

fn open(store: &Store, rank: usize, world: usize, token: &str) -> Result<Channel> {
    open_within(store, rank, world, token, Duration::from_secs(20))
}

fn open_within(store: &Store, rank: usize, world: usize, token: &str, timeout: Duration) -> Result<Channel> {
    let s = store.clone();
    Channel::open(rank, world, "127.0.0.1", token, timeout, move |k, v| s.share(k, v))
}

/// Rank 0 of `world` opening its channel on a thread (waiting up to `timeout`): its port,
/// and the outcome with how long it took, on a channel, so that a test bounds its own wait.
fn rank_zero(store: &Store, world: usize, timeout: Duration) -> (u16, mpsc::Receiver<(Result<Channel>, Duration)>) {
    let (tx, rx) = mpsc::channel();
    let s = store.clone();
    std::thread::spawn(move || {
        let t = Instant::now();
        let got = open_within(&s, 0, world, "tok", timeout);
        let _ = tx.send((got, t.elapsed()));
    });
    (store.listener_of(0).unwrap().port(), rx)
}

/// Rank 0's outcome, waiting at most `bound`.
fn outcome(rx: &mpsc::Receiver<(Result<Channel>, Duration)>, bound: Duration) -> (Result<Channel>, Duration) {
    rx.recv_timeout(bound)
        .unwrap_or_else(|_| panic!("rank 0 still waits after {bound:?}"))
}

/// Slack for a loaded 2-core machine over a timeout rank 0 must keep.
const MARGIN: Duration = Duration::from_millis(1500);

#[test]
fn a_silent_stranger_cannot_keep_rank_0_past_its_timeout() {
    let store = Store::default();
    let timeout = Duration::from_secs(2);
    let (port, rx) = rank_zero(&store, 2, timeout);
    let _silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (got, took) = outcome(&rx, timeout + MARGIN);
    let err = got.err().expect("no rank 1 came").to_string();
    assert!(took < timeout + MARGIN, "{took:?}: {err}");
    assert!(
        err.contains("0 of 1 other ranks connected")
            && err.contains("missing: 1")
            && err.contains("1 connection(s) that did not introduce themselves as ranks of this run were dropped"),
        "{err}"
    );
}

#[test]
fn a_flood_of_silent_connections_cannot_keep_rank_0_past_its_timeout() {
    let store = Store::default();
    let timeout = Duration::from_secs(3);
    let (port, rx) = rank_zero(&store, 2, timeout);
    // 50 connections that send nothing, one every 40 ms through most of the wait, all kept open.
    let silent: Vec<TcpStream> = (0..50)
        .map(|_| {
            std::thread::sleep(Duration::from_millis(40));
            TcpStream::connect(("127.0.0.1", port)).unwrap()
        })
        .collect();
    let (got, took) = outcome(&rx, timeout + MARGIN);
    let err = got.err().expect("no rank 1 came").to_string();
    assert!(took < timeout + MARGIN, "{took:?}: {err}");
    assert!(
        err.contains("0 of 1 other ranks connected") && err.contains("50 connection(s)"),
        "{err}"
    );
    drop(silent);
}

#[test]
fn a_rank_gets_in_while_strangers_sit_silent_or_send_garbage() {
    let store = Store::default();
    let (port, rx) = rank_zero(&store, 2, Duration::from_secs(20));
    let silent: Vec<TcpStream> = (0..5)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let mut garbage = TcpStream::connect(("127.0.0.1", port)).unwrap();
    garbage.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let t = Instant::now();
    let one = Exchange::new(open(&store, 1, 2, "tok").unwrap(), 1);
    let peer = std::thread::spawn(move || {
        let mut v = [2.0];
        one.run(Topic::Losses, &mut v).map(|_| v[0])
    });
    // Well inside HELLO_WAIT: rank 0 did not wait on the silent ones first.
    let (got, took) = outcome(&rx, Duration::from_secs(5));
    let zero = Exchange::new(got.unwrap(), 1);
    let mut v = [1.0];
    zero.run(Topic::Losses, &mut v).unwrap();
    assert_eq!((v[0], peer.join().unwrap().unwrap()), (2.0, 2.0));
    assert!(
        took < Duration::from_secs(5) && t.elapsed() < Duration::from_secs(5),
        "{took:?}"
    );
    // The garbage was answered by closing the connection (reset: its rest was never read).
    garbage.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    match garbage.read(&mut [0u8]) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the garbage's connection is still open: {other:?}"),
    }
    drop(silent);
}

#[test]
fn ranks_meet_at_the_maximum_and_strangers_are_turned_away() {
    let store = Store::default();
    let s = store.clone();
    let zero = std::thread::spawn(move || {
        let x = Exchange::new(open(&s, 0, 3, "tok").unwrap(), 4);
        let mut v = [1.0, f64::NAN, -3.0];
        x.run(Topic::Losses, &mut v).unwrap();
        v
    });
    let port = store.listener_of(0).unwrap().port();
    // A stray client with the wrong token, and one claiming rank 0: both dropped.
    let mut wrong = TcpStream::connect(("127.0.0.1", port)).unwrap();
    wrong.write_all(b"OGX1\x01\0\0\0\x03\0\0\0bad").unwrap();
    let mut zero_again = TcpStream::connect(("127.0.0.1", port)).unwrap();
    zero_again.write_all(b"OGX1\0\0\0\0\x03\0\0\0tok").unwrap();
    let others: Vec<_> = [(1, [2.0, 0.0, -5.0]), (2, [0.5, 7.0, -4.0])]
        .into_iter()
        .map(|(rank, mut v)| {
            let s = store.clone();
            std::thread::spawn(move || {
                Exchange::new(open(&s, rank, 3, "tok").unwrap(), 4)
                    .run(Topic::Losses, &mut v)
                    .unwrap();
                v
            })
        })
        .collect();
    let want = [2.0, f64::NAN, -3.0];
    for v in std::iter::once(zero).chain(others).map(|t| t.join().unwrap()) {
        assert_eq!(format!("{v:?}"), format!("{want:?}"));
    }
    // The strangers' connections were closed without an answer.
    let mut byte = [0u8];
    assert_eq!(wrong.read(&mut byte).unwrap(), 0);
    assert_eq!(zero_again.read(&mut byte).unwrap(), 0);
}

#[test]
fn a_rank_that_goes_away_is_an_error_not_a_hang() {
    let store = Store::default();
    let s = store.clone();
    let one = std::thread::spawn(move || drop(open(&s, 1, 2, "").unwrap()));
    let x = Exchange::new(open(&store, 0, 2, "").unwrap(), 1);
    one.join().unwrap();
    let err = x.run(Topic::Stop, &mut [0.0]).unwrap_err().to_string();
    assert!(err.contains("the exchange with rank 1: the connection closed"), "{err}");
}

#[test]
fn ranks_at_different_exchanges_fail_naming_both() {
    let store = Store::default();
    let s = store.clone();
    let one = std::thread::spawn(move || {
        let x = Exchange::new(open(&s, 1, 2, "").unwrap(), 1);
        x.step.set(7);
        x.run(Topic::Agreement, &mut [0.0]).unwrap_err().to_string()
    });
    let x = Exchange::new(open(&store, 0, 2, "").unwrap(), 1);
    x.step.set(7);
    let zero = x.run(Topic::Losses, &mut [0.0]).unwrap_err().to_string();
    let one = one.join().unwrap();
    for e in [&zero, &one] {
        assert!(
            e.contains("collective mismatch") && e.contains("the agreement on a step's attempt .. the losses"),
            "{e}"
        );
    }
    assert!(
        zero.contains("this rank is at exchange 1 (the losses, step 7)"),
        "{zero}"
    );
}

/// `world` ranks on threads, each running `f` with its exchange; their results in rank order.
fn ranks<T: Send + 'static>(world: usize, f: impl Fn(usize, Exchange) -> T + Send + Sync + 'static) -> Vec<T> {
    let store = Store::default();
    let f = Arc::new(f);
    let threads: Vec<_> = (0..world)
        .map(|r| {
            let (s, f) = (store.clone(), f.clone());
            std::thread::spawn(move || f(r, Exchange::new(open(&s, r, world, "tok").unwrap(), 4)))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn sixty_four_ranks_agree_on_the_maximum_and_the_sum_in_constant_bytes() {
    let got = ranks(64, |r, x| {
        let mut v = [r as f64, -(r as f64), if r == 37 { f64::NAN } else { 0.0 }];
        x.run(Topic::Losses, &mut v).unwrap();
        let mut s = [1.0 + r as f64 / 8.0];
        x.run_as(Topic::EvalLosses, &mut s, Reduce::Sum).unwrap();
        (format!("{v:?}"), s[0].to_bits(), x.bytes_moved())
    });
    let want_sum: f64 = (0..64).map(|r| 1.0 + r as f64 / 8.0).sum();
    for (v, sum, _) in &got {
        assert_eq!(v, &format!("{:?}", [63.0, -0.0, f64::NAN]));
        // One sum, the same bits everywhere.
        assert_eq!(*sum, got[0].1);
        assert!((f64::from_bits(*sum) - want_sum).abs() < 1e-9, "{sum} vs {want_sum}");
    }
    // Two exchanges of (6 + 4) values each: a rank moves one message per neighbour each way,
    // three neighbours at most.
    let msg = 8 * (HEADER as u64 + 4);
    let most = got.iter().map(|g| g.2).max().unwrap();
    assert_eq!(most, 2 * 2 * busiest_neighbours(64) * msg);
    assert_eq!(got[63].2, 2 * 2 * msg, "a leaf talks to its parent only");
}

#[test]
fn sixty_four_ranks_at_different_exchanges_all_fail_naming_both() {
    let errs = ranks(64, |r, x| {
        x.step.set(3);
        let topic = if r == 50 { Topic::Agreement } else { Topic::Losses };
        x.run(topic, &mut [0.0]).unwrap_err().to_string()
    });
    for e in errs {
        assert!(
            e.contains("collective mismatch") && e.contains("the agreement on a step's attempt .. the losses"),
            "{e}"
        );
    }
}

#[test]
fn a_dead_rank_among_sixty_four_fails_every_other_within_seconds() {
    let t = Instant::now();
    let errs = ranks(64, |r, x| {
        x.run(Topic::Losses, &mut [1.0]).unwrap();
        if r == 21 {
            return None; // dies: its connections close
        }
        Some(x.run(Topic::Losses, &mut [1.0]).unwrap_err().to_string())
    });
    let took = t.elapsed();
    let errs: Vec<String> = errs.into_iter().flatten().collect();
    assert_eq!(errs.len(), 63);
    for e in &errs {
        assert!(
            e.contains("the connection closed") || e.contains("closed after an earlier failure"),
            "{e}"
        );
    }
    // Its neighbours name it; the timeout (20 s) was never waited for.
    assert!(errs
        .iter()
        .any(|e| e.contains("the exchange with rank 21: the connection closed")));
    assert!(took < Duration::from_secs(10), "{took:?}");
}

#[test]
fn loopbacks_interface_is_found_by_its_address() {
    assert_eq!(interface_of("127.0.0.1".parse().unwrap()).as_deref(), Some("lo"));
    assert_eq!(interface_of("192.0.2.77".parse().unwrap()), None);
}
