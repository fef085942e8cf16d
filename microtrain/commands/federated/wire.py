"""What travels between the server and the devices, and how much of it.

Only the trainable weights travel: the flat fp32 vector the .wof holds, as one
array.  With `transmit="fp16"` both directions carry it rounded to float16 (half
the bytes); the server keeps and aggregates fp32 weights, and each device trains
in fp32 and replies in the type it received.  `WireGrid` applies the encoding at
the boundary (the strategy never sees fp16) and counts the bytes.
"""
import numpy as np
from flwr.app import Array, ArrayRecord, Message, MessageType

ARRAYS_KEY = "arrays"   # the strategies' default key of the ArrayRecord in a message
WIRE_DTYPES = {"fp32": np.float32, "fp16": np.float16}


def to_record(flat: np.ndarray, dtype=np.float32) -> ArrayRecord:
    return ArrayRecord({"wof": Array(np.ascontiguousarray(flat, dtype=dtype))})


def from_record(record: ArrayRecord) -> np.ndarray:
    """The flat weights of a record, as fp32."""
    return record["wof"].numpy().astype(np.float32)


def record_bytes(record: ArrayRecord) -> int:
    """Bytes of the arrays as Flower serialises them (numpy's .npy bytes)."""
    return sum(len(array.data) for array in record.values())


class WireGrid:
    """A Flower Grid whose messages carry the weights in the wire type, counting
    per round the replies, failures and array bytes in each direction."""

    def __init__(self, grid, transmit: str):
        self.grid, self.dtype = grid, WIRE_DTYPES[transmit]
        self.reset()

    def reset(self) -> None:
        self.replies = self.failures = self.bytes_down = self.bytes_up = 0
        self.sums: dict[str, float] = {}     # metric -> sum of value x examples, over replies
        self.examples: dict[str, int] = {}

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for message in messages:
            self._encode(message)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            self._decode(reply)
        return replies

    def _encode(self, message: Message) -> None:
        record = message.content.array_records.get(ARRAYS_KEY)
        if record is not None:
            wire = to_record(from_record(record), self.dtype)
            message.content[ARRAYS_KEY] = wire
            self.bytes_down += record_bytes(wire)

    def _decode(self, reply: Message) -> None:
        """Count a reply: `replies`/`failures` count training replies (the devices
        whose update is aggregated); metrics of every reply are averaged."""
        training = reply.metadata.message_type == MessageType.TRAIN
        if reply.has_error():
            self.failures += training
            return
        self.replies += training
        record = reply.content.array_records.get(ARRAYS_KEY)
        if record is not None:
            self.bytes_up += record_bytes(record)
            reply.content[ARRAYS_KEY] = to_record(from_record(record))
        for metrics in reply.content.metric_records.values():
            n = int(metrics.get("num-examples", 0))
            for key, value in metrics.items():
                if key != "num-examples":
                    self.sums[key] = self.sums.get(key, 0.0) + float(value) * n
                    self.examples[key] = self.examples.get(key, 0) + n

    def means(self) -> dict[str, float]:
        """The devices' metrics this round, each averaged weighting by examples."""
        return {k: self.sums[k] / self.examples[k] for k in sorted(self.sums) if self.examples[k]}

    def __getattr__(self, name):  # the rest of the Grid API, unchanged
        return getattr(self.grid, name)
