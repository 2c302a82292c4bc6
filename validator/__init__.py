"""rollbook.validator"""
