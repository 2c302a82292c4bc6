"""rollbook.rollout"""
