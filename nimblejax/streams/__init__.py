"""Stream assignment, launch schedules and race verification (Nimble §4)."""
from nimblejax.streams.assign import StreamAssignment, assign_streams
from nimblejax.streams.schedule import Schedule, critical_path, make_schedule
from nimblejax.streams.verify import Violation, verify

__all__ = ["StreamAssignment", "assign_streams", "Schedule", "critical_path",
           "make_schedule", "Violation", "verify"]
