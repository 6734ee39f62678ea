"""Reads a strata run's TensorBoard log directory with TensorBoard's own
event reader and prints what it finds; exits 1 if it finds no scalars.

    pip install tensorboard
    strata train --tensorboard runs/tb ...
    python scripts/tensorboard/check_events.py runs/tb
"""

import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main():
    acc = EventAccumulator(sys.argv[1])
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if not tags:
        sys.exit(f"{sys.argv[1]}: TensorBoard finds no scalars")
    for tag in sorted(tags):
        events = acc.Scalars(tag)
        first, last = events[0], events[-1]
        print(f"{tag}: {len(events)} points, step {first.step} = {first.value:.6g} "
              f"... step {last.step} = {last.value:.6g}")


if __name__ == "__main__":
    main()
