"""rollbook.store"""
