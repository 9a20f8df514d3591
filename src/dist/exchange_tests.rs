//! The exchange's channel between threads of one process, over loopback.
use super::*;
use std::sync::{Arc, Condvar, Mutex};

/// The store's part in `Channel::open`: rank 0 sets the key, the others wait for it.
#[derive(Clone, Default)]
struct Store(Arc<(Mutex<Option<Vec<u8>>>, Condvar)>);

impl Store {
    fn share(&self, _key: &str, value: Option<&[u8]>) -> Result<Vec<u8>> {
        let (m, c) = &*self.0;
        let mut v = m.lock().unwrap();
        if let Some(value) = value {
            *v = Some(value.to_vec());
            c.notify_all();
        }
        Ok(c.wait_while(v, |v| v.is_none()).unwrap().clone().unwrap())
    }
}

fn open(store: &Store, rank: usize, world: usize, token: &str) -> Result<Channel> {
    let s = store.clone();
    Channel::open(rank, world, "127.0.0.1", token, Duration::from_secs(20), move |k, v| {
        s.share(k, v)
    })
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
    let port: u16 = String::from_utf8(store.share("", None).unwrap())
        .unwrap()
        .parse()
        .unwrap();
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
