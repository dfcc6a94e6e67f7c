"""Stream assignment, launch schedules and race verification (Nimble §4)."""
from nimblejax.compiler.streams.assign import StreamAssignment, assign_streams
from nimblejax.compiler.streams.schedule import STREAM_CAP, Schedule, critical_path, make_schedule
from nimblejax.compiler.streams.verify import Violation, verify

__all__ = ["StreamAssignment", "assign_streams", "Schedule", "critical_path",
           "make_schedule", "STREAM_CAP", "Violation", "verify"]
