"""ClientApp: zero training compute (the same work fedq's zero-compute clients do)."""

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    # np.asarray: a 0-d array plus a float is a NumPy scalar, which ArrayRecord refuses
    # (ResNet-18's num_batches_tracked entries are 0-d).
    changed = ArrayRecord([np.asarray(a + 1e-4, dtype=a.dtype) for a in arrays])
    return Message(content=RecordDict({"arrays": changed,
                                       "metrics": MetricRecord({"num-examples": 1})}),
                   reply_to=msg)
