"""rollbook.trainer"""
