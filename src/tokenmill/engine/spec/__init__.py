"""Speculative decoding: proposers guess a request's next tokens; the target model verifies them.

`proposer.py` is the interface and its factory, `ngram.py` and `draft.py` the two methods, and
`stats.py` the counters. The verification itself lives with the sampler (sample/speculative.py):
the engine schedules a decode row plus its drafts as one chunk and accepts what the sampler agrees with.
"""
