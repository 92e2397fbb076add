#!/bin/sh
echo "hello from $(cat /etc/greeting)"
