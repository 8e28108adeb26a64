"""emashadow: a trainer that keeps an exponential moving average of the weights for evaluation."""
