"""The pipeline's commands: fetch, bpe, bucket, average, decode, score, export, import, plots."""
