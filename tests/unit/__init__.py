"""One part at a time, with controlled fakes and forced orderings: a failure here names the part that broke."""
