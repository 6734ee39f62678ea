use super::*;
use crate::comm::{InProcessComm, Link, ModeledLink};

fn unit_link() -> LinkFit {
    LinkFit {
        fixed_s: 1.0,
        s_per_byte: 0.1,
    }
}

/// Two devices, experts 0 and 1 on device 0 and 2 and 3 on device 1, each
/// device routing 10 rows to each expert.
fn even_load() -> (Vec<Vec<u32>>, Vec<u16>) {
    (vec![vec![10; 4]; 2], vec![0, 0, 1, 1])
}

#[test]
fn one_part_is_dispatch_then_compute_then_combine() {
    let (counts, owner) = even_load();
    let load = LayerLoad {
        counts: &counts,
        owner: &owner,
        row_bytes: 1,
        s_per_row: 0.1,
        s_per_expert: 0.0,
    };
    // Each device sends 20 rows away and receives 20: 1 + 2 s each way;
    // it computes its 40 rows in 4 s.
    let t = predict(&unit_link(), &load, &[0, 0, 0, 0], 1);
    assert!((t - 10.0).abs() < 1e-9, "{t}");
}

#[test]
fn two_parts_overlap_a_dispatch_and_a_combine_with_compute() {
    let (counts, owner) = even_load();
    let load = LayerLoad {
        counts: &counts,
        owner: &owner,
        row_bytes: 1,
        s_per_row: 0.1,
        s_per_expert: 0.0,
    };
    // Part 0 (experts 0, 2): dispatched at 2 s, computed 2..4, combined
    // 4..6. Part 1: dispatched 2..4, computed 4..6, combined 6..8.
    let t = predict(&unit_link(), &load, &[0, 1, 0, 1], 2);
    assert!((t - 8.0).abs() < 1e-9, "{t}");
    // A part's combine waits for the slower device's experts: device 1
    // computing twice the rows of part 1 delays the last combine.
    let mut heavy = counts.clone();
    heavy[0][3] = 30;
    let load = LayerLoad {
        counts: &heavy,
        ..load
    };
    // Part 1 now sends 30 rows from device 0: dispatched 2..6; device 1
    // computes its 40 rows 6..10; combined 10..14.
    let t = predict(&unit_link(), &load, &[0, 1, 0, 1], 2);
    assert!((t - 14.0).abs() < 1e-9, "{t}");
}

#[test]
fn the_busiest_rank_is_the_one_that_sends_or_receives_the_most() {
    // Three devices, expert e on device e; rows of 2 bytes.
    let owner = [0u16, 1, 2];
    let time = |counts: &[Vec<u32>]| {
        let load = LayerLoad {
            counts,
            owner: &owner,
            row_bytes: 2,
            s_per_row: 0.1,
            s_per_expert: 0.0,
        };
        predict(&unit_link(), &load, &[0, 0, 0], 1)
    };
    // Device 0 sends 10 rows to each of the others: it sends 20 (40
    // bytes, 5 s each way), each of them receives 10 and computes them in
    // 1 s.
    let sends = time(&[vec![0, 10, 10], vec![0; 3], vec![0; 3]]);
    assert!((sends - 11.0).abs() < 1e-9, "{sends}");
    // The others send 10 each to device 0: it receives 20 and computes
    // them in 2 s.
    let receives = time(&[vec![0; 3], vec![10, 0, 0], vec![10, 0, 0]]);
    assert!((receives - 12.0).abs() < 1e-9, "{receives}");
}

#[test]
fn experts_without_rows_and_parts_without_work_cost_a_collective_alone() {
    let (counts, owner) = even_load();
    let load = LayerLoad {
        counts: &counts,
        owner: &owner,
        row_bytes: 1,
        s_per_row: 0.1,
        s_per_expert: 0.0,
    };
    // Expert 3 in no part; part 1 holds nothing: its two collectives cost
    // their fixed time each.
    let t = predict(&unit_link(), &load, &[0, 0, 0, usize::MAX], 2);
    // Part 0 (experts 0, 1, 2): device 1 sends 20 rows, device 0
    // receives 20: dispatched 0..3; part 1's empty dispatch 3..4. Device 0
    // computes its 40 rows 3..7, so part 0 combines 7..10 and part 1's
    // empty combine 10..11.
    assert!((t - 11.0).abs() < 1e-9, "{t}");
}

#[test]
fn a_projection_splits_each_device_s_experts_and_hides_compute_behind_the_wire() {
    // Two devices, four experts (two each), 10 rows from each device to
    // each expert: `even_load`'s layer.
    let layer = UniformLayer {
        devices: 2,
        experts: 4,
        rows_per_expert: 10,
        row_bytes: 1,
        s_per_row: 0.1,
    };
    let times = project_exchange(&unit_link(), &layer);
    assert_eq!(times.len(), MAX_PARTS);
    // As worked above: 10 s in one part, 8 in two; no device has a third
    // expert, so every count past two is two parts.
    assert!((times[0] - 10.0).abs() < 1e-9 && (times[1] - 8.0).abs() < 1e-9);
    assert!(times[2..].iter().all(|&t| t == times[1]), "{times:?}");
    // With nothing to hide, a second part only adds its collectives.
    let idle = project_exchange(
        &unit_link(),
        &UniformLayer {
            s_per_row: 0.0,
            ..layer
        },
    );
    assert!(idle[1] > idle[0], "{idle:?}");
}

#[test]
fn a_line_is_fitted_through_its_points_never_below_zero() {
    let fit = LinkFit::through(&[(0.0, 1.0), (10.0, 2.0), (20.0, 3.0)]);
    assert!((fit.fixed_s - 1.0).abs() < 1e-12 && (fit.s_per_byte - 0.1).abs() < 1e-12);
    let falling = LinkFit::through(&[(0.0, 3.0), (10.0, 1.0)]);
    assert_eq!(falling.s_per_byte, 0.0);
    assert!(falling.fixed_s > 0.0);
    let one = LinkFit::through(&[(5.0, 2.0)]);
    assert_eq!((one.fixed_s, one.s_per_byte), (2.0, 0.0));
}

#[test]
fn calibration_finds_a_modeled_link_and_every_rank_holds_the_same_fit() {
    // 0.1 GB/s with 2 ms of latency, three ranks: 2 MiB to each of the two
    // peers takes 42 ms more than nothing does.
    let link = Link::new(0.1, 2000.0).unwrap();
    let fits: Vec<LinkFit> = std::thread::scope(|s| {
        let handles: Vec<_> = InProcessComm::endpoints(3)
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let mut comm = ModeledLink::new(c, Some(link));
                    calibrate(&mut comm).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(fits.iter().all(|f| *f == fits[0]), "{fits:?}");
    let fit = fits[0];
    let rate = 1.0 / fit.s_per_byte / 1e9;
    assert!((0.07..=0.11).contains(&rate), "{rate} GB/s: {fit:?}");
    // The latency and a collective's own costs, averaged over the ranks.
    assert!(
        (0.0015..=0.0045).contains(&fit.fixed_s),
        "{} s fixed: {fit:?}",
        fit.fixed_s
    );
}

/// The placement measures an expert's cost per row over its forward and
/// backward together: the passes' shares are the whole of it, the
/// backward's twice the forward's (two GEMMs of each one's shape); a row
/// on the wire is d_model f32s. The exchange's own work per row adds
/// its pass's measure to each.
#[test]
fn a_layer_s_passes_share_the_cost_per_row_one_to_two() {
    let (counts, owner) = even_load();
    let f = LayerLoad::in_pass(&counts, &owner, 48, (0.3, [0.0; 2]), Pass::Forward);
    let b = LayerLoad::in_pass(&counts, &owner, 48, (0.3, [0.0; 2]), Pass::Backward);
    assert_eq!((f.row_bytes, b.row_bytes), (192, 192));
    assert!((f.s_per_row + b.s_per_row - 0.3).abs() < 1e-15);
    assert!((b.s_per_row - 2.0 * f.s_per_row).abs() < 1e-15);
    let local = [0.01, 0.05];
    let lf = LayerLoad::in_pass(&counts, &owner, 48, (0.3, local), Pass::Forward);
    let lb = LayerLoad::in_pass(&counts, &owner, 48, (0.3, local), Pass::Backward);
    assert_eq!((lf.s_per_row, lf.s_per_expert), (f.s_per_row, 0.01));
    assert_eq!((lb.s_per_row, lb.s_per_expert), (b.s_per_row, 0.05));
}

/// The own work's cost per expert: each pass's seconds over the experts
/// the device computed in it; nothing without experts.
#[test]
fn the_own_work_is_costed_per_expert_and_pass() {
    assert_eq!(local_cost([0.2, 0.6], [20, 30]), [0.01, 0.02]);
    assert_eq!(local_cost([0.2, 0.6], [0, 30]), [0.0, 0.02]);
}

/// Each expert adds its device's own work to that device's time in its
/// part: one part, one device of two experts and one of one, no wire.
#[test]
fn each_expert_adds_its_own_work_to_its_device() {
    let counts = vec![vec![10, 10, 10]];
    let owner = vec![0u16, 0, 0];
    let free = LinkFit {
        fixed_s: 0.0,
        s_per_byte: 0.0,
    };
    let load = LayerLoad {
        counts: &counts,
        owner: &owner,
        row_bytes: 4,
        s_per_row: 0.001,
        s_per_expert: 0.5,
    };
    let t = predict(&free, &load, &[0, 0, 0], 1);
    assert!((t - (30.0 * 0.001 + 3.0 * 0.5)).abs() < 1e-12, "{t}");
    let t = predict(&free, &load, &[0, 0, usize::MAX], 1);
    assert!((t - (20.0 * 0.001 + 2.0 * 0.5)).abs() < 1e-12, "{t}");
}
