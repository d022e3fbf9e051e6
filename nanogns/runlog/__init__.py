"""runlog"""
