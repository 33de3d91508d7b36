"""The paper's Transformer (Vaswani et al., 2017) and the seeds' variants: weights and maths only."""
