"""lossbook: a trainer that sums each loss term between log lines."""
