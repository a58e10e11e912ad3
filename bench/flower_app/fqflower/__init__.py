"""fedq's Flower benchmark app: the ClientApp returns the arrays it got plus a small
change; the ServerApp runs Flower's FedAvg and stamps the time after each round."""
