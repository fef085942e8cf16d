"""What travels between the server and the devices, and how much of it.

Only the trainable weights travel: the flat fp32 vector the .wof holds, as one
array.  With `transmit="fp16"` both directions carry it rounded to float16 (half
the bytes); the server keeps and aggregates fp32 weights, and each device trains
in fp32 and replies in the type it received.  `WireGrid` applies the encoding at
the boundary (the strategy never sees fp16) and counts the bytes.
"""
import numpy as np
from flwr.app import Array, ArrayRecord, Message

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
        self.train_loss, self.examples = 0.0, 0

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
        if reply.has_error():
            self.failures += 1
            return
        self.replies += 1
        record = reply.content.array_records.get(ARRAYS_KEY)
        if record is not None:
            self.bytes_up += record_bytes(record)
            reply.content[ARRAYS_KEY] = to_record(from_record(record))
        metrics = reply.content.metric_records.get("metrics")
        if metrics is not None and "train_loss" in metrics:
            self.train_loss += float(metrics["train_loss"]) * int(metrics["num-examples"])
            self.examples += int(metrics["num-examples"])

    def mean_train_loss(self) -> float | None:
        return self.train_loss / self.examples if self.examples else None

    def __getattr__(self, name):  # the rest of the Grid API, unchanged
        return getattr(self.grid, name)
