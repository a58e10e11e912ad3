"""ClientApp: zero training compute (the same work fedq's zero_compute clients do)."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    changed = ArrayRecord([a + 1e-4 for a in arrays])
    return Message(content=RecordDict({"arrays": changed,
                                       "metrics": MetricRecord({"num-examples": 1})}),
                   reply_to=msg)
