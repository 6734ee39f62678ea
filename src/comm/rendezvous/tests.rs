use std::collections::HashMap;
use std::thread::JoinHandle;

use super::*;

const LONG: Duration = Duration::from_secs(30);

fn world(rank: usize, size: usize, port: u16) -> World {
    World {
        rank,
        size,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

fn listener() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

fn peer(
    addr: SocketAddr,
    rank: usize,
    size: usize,
    timeout: Duration,
) -> JoinHandle<Result<Vec<u8>, CommError>> {
    std::thread::spawn(move || {
        join(
            addr,
            &world(rank, size, addr.port()),
            Instant::now() + timeout,
        )
    })
}

fn why(e: CommError) -> String {
    match e {
        CommError::Init { why } => why,
        other => panic!("not an init error: {other:?}"),
    }
}

#[test]
fn every_rank_gets_rank_0_s_bytes_whoever_starts_first() {
    let (listener, addr) = listener();
    // The peers start first and retry; rank 0 comes 100 ms later.
    let peers: Vec<_> = (1..4).map(|r| peer(addr, r, 4, LONG)).collect();
    std::thread::sleep(Duration::from_millis(100));
    let offer: Vec<u8> = (0..128).collect();
    let mine = serve(listener, 4, offer.clone(), Instant::now() + LONG).unwrap();
    assert_eq!(mine, offer);
    for p in peers {
        assert_eq!(p.join().unwrap().unwrap(), offer);
    }
}

#[test]
fn rendezvous_binds_the_master_s_port_and_meets_there() {
    let port = listener().1.port(); // free a moment ago
    let peer = std::thread::spawn(move || rendezvous(&world(1, 2, port), Vec::new, LONG));
    let mine = rendezvous(&world(0, 2, port), || b"id".to_vec(), LONG).unwrap();
    assert_eq!(mine, b"id");
    assert_eq!(peer.join().unwrap().unwrap(), b"id");
    // Alone, rank 0 meets nobody and keeps its own offer.
    assert_eq!(
        rendezvous(&world(0, 1, 0), || b"x".to_vec(), LONG).unwrap(),
        b"x"
    );
}

#[test]
fn a_world_size_that_differs_is_refused_on_both_sides() {
    let (listener, addr) = listener();
    let wrong = peer(addr, 1, 3, LONG);
    let e = why(serve(listener, 2, vec![1], Instant::now() + LONG).unwrap_err());
    assert!(e.contains("rank 1 says WORLD_SIZE=3, rank 0 has 2"), "{e}");
    let e = why(wrong.join().unwrap().unwrap_err());
    assert!(
        e.contains("rank 0 refused rank 1") && e.contains("WORLD_SIZE=3"),
        "{e}"
    );
}

#[test]
fn a_rank_claimed_twice_is_refused_and_every_rank_that_came_told() {
    let (listener, addr) = listener();
    let first = peer(addr, 1, 3, LONG);
    std::thread::sleep(Duration::from_millis(100));
    let second = peer(addr, 1, 3, LONG);
    let e = why(serve(listener, 3, vec![1], Instant::now() + LONG).unwrap_err());
    assert!(e.contains("two processes say RANK=1"), "{e}");
    for p in [first, second] {
        let e = why(p.join().unwrap().unwrap_err());
        assert!(e.contains("two processes say RANK=1"), "{e}");
    }
}

#[test]
fn a_rank_that_never_comes_is_named_once_the_timeout_passes() {
    let (listener, addr) = listener();
    let came = peer(addr, 2, 3, LONG);
    let start = Instant::now();
    let e = why(serve(listener, 3, vec![1], start + Duration::from_millis(300)).unwrap_err());
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(e.contains("rank(s) 1 never came"), "{e}");
    // The rank that came learns it too, instead of waiting.
    let e = why(came.join().unwrap().unwrap_err());
    assert!(e.contains("rank(s) 1 never came"), "{e}");
}

#[test]
fn a_rank_with_no_rank_0_names_the_address_once_the_timeout_passes() {
    let addr = listener().1; // nobody listens there now
    let start = Instant::now();
    let e = why(peer(addr, 1, 2, Duration::from_millis(300))
        .join()
        .unwrap()
        .unwrap_err());
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(e.contains(&format!("found no rank 0 at {addr}")), "{e}");
}

#[test]
fn something_else_on_the_port_is_refused_by_name_and_the_ranks_told() {
    let (listener, addr) = listener();
    let came = peer(addr, 1, 3, LONG);
    std::thread::sleep(Duration::from_millis(100));
    let stranger = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    });
    let e = why(serve(listener, 3, vec![1], Instant::now() + LONG).unwrap_err());
    assert!(e.contains("something other than a strata rank"), "{e}");
    stranger.join().unwrap();
    let e = why(came.join().unwrap().unwrap_err());
    assert!(e.contains("something other than a strata rank"), "{e}");
}

#[test]
fn an_offer_too_large_is_refused_before_anyone_waits() {
    let (listener, _) = listener();
    let e = why(serve(listener, 2, vec![0; MAX_OFFER + 1], Instant::now() + LONG).unwrap_err());
    assert!(e.contains("at most"), "{e}");
}

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| map.get(name).cloned()
}

#[test]
fn the_environment_gives_the_world_or_says_what_is_wrong() {
    assert_eq!(World::from_vars(vars(&[])).unwrap(), None);
    let full = [
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "node7"),
        ("MASTER_PORT", "29500"),
    ];
    assert_eq!(
        World::from_vars(vars(&full)).unwrap(),
        Some(World {
            local_rank: 0,
            master_addr: "node7".into(),
            ..world(2, 4, 29500)
        })
    );
    // LOCAL_RANK defaults to RANK; one rank needs no master.
    let alone = World::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap();
    assert_eq!(alone, Some(world(0, 1, 0)));
    let refused = |pairs: &[(&str, &str)], says: &str| {
        let e = why(World::from_vars(vars(pairs)).unwrap_err());
        assert!(e.contains(says), "{pairs:?}: {e}");
    };
    refused(&[("RANK", "1")], "WORLD_SIZE is not set, but RANK is");
    refused(&[("WORLD_SIZE", "2")], "RANK is not set, but WORLD_SIZE is");
    refused(
        &[("RANK", "2"), ("WORLD_SIZE", "2")],
        "RANK must be below WORLD_SIZE",
    );
    refused(
        &[("RANK", "0"), ("WORLD_SIZE", "0")],
        "RANK must be below WORLD_SIZE",
    );
    refused(
        &[("RANK", "one"), ("WORLD_SIZE", "2")],
        "RANK=\"one\" is not a whole number",
    );
    refused(
        &[("RANK", "0"), ("WORLD_SIZE", "2")],
        "MASTER_ADDR is not set",
    );
    refused(
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
        "MASTER_PORT is not set",
    );
    refused(
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "70000"),
        ],
        "MASTER_PORT=\"70000\" is not a port",
    );
    refused(
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "-1")],
        "LOCAL_RANK=\"-1\"",
    );
}
